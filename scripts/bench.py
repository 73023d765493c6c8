"""Benchmark decode/prefill against the measured roofline (see ``jaxinfer.benchmark``).

Usage (on the GPU machine)::

    PYTHONPATH=. python3 scripts/bench.py --model llama-3.1-8b --impl reference,pallas \
        --batch 1,8 --context 1024,8192 --prompt-lens 128,2048,8192

Same flags as ``jaxinfer bench``.
"""

from __future__ import annotations

import sys

from jaxinfer.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
