"""Regenerates the committed Python stubs from the .proto files.

    python -m proto.generate            # rewrite the stubs in place (run from the repository root)
    python -m proto.generate --out DIR  # write them under DIR/proto/... instead (the stub test does this)

The standard services' copies (proto/grpc/...) are compiled with the repository root as the include path, so a
stub's own imports read `from proto.grpc... import ...` and resolve inside the installed `proto` package. Our own
service's file is compiled from proto/ (CANONICAL): its descriptor is registered as `hybridspec/v1/generation.proto`,
the name a client gets compiling the same file with `-Iproto`, so such a client's stubs load beside ours (the same
file twice is one file to protobuf; the same symbols from two file names clash: "duplicate symbol"). Its stubs'
module references are rewritten to the `proto.` package they live in.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent

# .proto files relative to the repository root
PROTO_FILES = (
    "proto/hybridspec/v1/generation.proto",
    "proto/grpc/health/v1/health.proto",
    "proto/grpc/reflection/v1/reflection.proto",
    "proto/grpc/reflection/v1alpha/reflection.proto",
)

# Lines that only record which protoc / grpcio-tools version generated a stub. They are normalized away when
# stubs are compared, so a newer grpcio-tools does not by itself fail the freshness test.
_VERSION_STAMPS = (
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^(\s*_runtime_version\.Domain\.PUBLIC,)\s*\n(?:\s*\d+,\s*\n){3}", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
)


# files compiled from proto/ (registered without the `proto/` prefix); their stubs' module paths get it back
CANONICAL = ("proto/hybridspec/v1/generation.proto",)


def stub_paths(root: Path = ROOT) -> list[Path]:
    """Every generated file for PROTO_FILES under `root`."""
    out = []
    for name in PROTO_FILES:
        base = root / name[: -len(".proto")]
        out += [base.with_name(base.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return out


def generate(out_root: Path = ROOT) -> list[Path]:
    """Compiles PROTO_FILES into `out_root` (same relative layout); returns the generated files."""
    from grpc_tools import protoc  # a build-time tool; only needed here

    out_root.mkdir(parents=True, exist_ok=True)
    rooted = [f for f in PROTO_FILES if f not in CANONICAL]
    canonical = [f[len("proto/"):] for f in CANONICAL]  # e.g. hybridspec/v1/generation.proto
    for include, out, files in ((ROOT, out_root, rooted), (PROTO_DIR, out_root / "proto", canonical)):
        out.mkdir(parents=True, exist_ok=True)
        args = ["grpc_tools.protoc", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for name in canonical:  # module references: hybridspec.v1.generation_pb2 -> proto.hybridspec.v1.generation_pb2
        module = name[: -len(".proto")].replace("/", ".")
        for path in stub_paths(out_root):
            if path.suffix == ".py" and path.exists():
                text = path.read_text()
                fixed = re.sub(rf"(?<![\w.]){re.escape(module)}_pb2\b", f"proto.{module}_pb2", text)
                fixed = re.sub(rf"^from {re.escape(module.rsplit('.', 1)[0])} import ",
                               f"from proto.{module.rsplit('.', 1)[0]} import ", fixed, flags=re.M)
                if fixed != text:
                    path.write_text(fixed)
    return stub_paths(out_root)


def normalized(text: str) -> str:
    """Stub text without its generator-version stamps."""
    for pattern in _VERSION_STAMPS:
        text = pattern.sub(lambda m: m.group(1) if m.groups() else "", text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
