"""hybridspec protocol packages."""
