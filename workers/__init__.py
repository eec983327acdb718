"""Code that runs next to the accelerator: model layers, weight loading, drafters, sampling, the runner."""
