"""Startup verification: prove in each worker that every selected optimization is what serves, and
that its kernels compute right, before the server accepts a request.

It runs once per worker process (:mod:`.once`, through patch P6 when a model runner has loaded the
target and its draft (the NEXTN layer or the DSpark drafter) and shared modules between them). The
proof reads the records; it never derives a choice again:

- :mod:`.census`: one pass over the loaded models gives, for every module that serves a feature,
  the selection recorded on it and what it serves, read by the feature's reader;
- :mod:`.recorded`: the one check every feature gets, each module serves what it recorded (and
  as many modules as the pipeline stage holds); :mod:`.optimizations`: the report's entries;
- the other families, one module each: :mod:`.known_answers` (every serving kernel on scratch
  layers) and :mod:`.vllm_agreement` (our kernels against vLLM's on a served layer),
  :mod:`.draft_sharing`, :mod:`.speculative`, :mod:`.model_classes`, :mod:`.versions`,
  :mod:`.prefill_graphs` and :mod:`.decode_splits` (decisions made on the config, before any module exists),
  :mod:`.ranks` (gather and merge every rank's entry), :mod:`.attention_backends` (a fact, not a
  check: the backend each attention layer holds), :mod:`.assembly` (the report),
  :mod:`.policy` (strict / warn / off), :mod:`.formatting` (the INFO table);
- :mod:`.checks` (the one result type, and an exception inside a check is its failure),
  :mod:`.stage` (this process's pipeline stage), :mod:`.negative_control` (tests).

Every check returns :class:`~.checks.Check`; the report's ``checks`` are those rows. Output: one
INFO table, the JSON report (``VLLM_LING_REPORT_PATH``, atomically replaced) and through it the
``vllm_ling:*`` metrics. Policy ``VLLM_LING_VERIFY``: ``strict`` (the default) raises
:class:`~.policy.LingVerificationError` so the server refuses to start; ``warn`` logs each failed
check; ``off`` skips the checks (logged once).

Adding a feature (a new kernel, a drafter) takes no code here:

1. its selector beside it (``ops/<feature>/selection.py``, or where its policy lives) returns a
   :class:`vllm_ling.selection.Selection` of a new :class:`~vllm_ling.selection.Feature` (a
   subclass with ``served_as`` where it carries switches), and the module that serves it records
   the answer on itself (:func:`vllm_ling.selection.record`), again after any later decision that
   changes what serves (with ``fallback_from``);
2. its :class:`~vllm_ling.selection.Reader` beside the layer code, listed in
   :func:`vllm_ling.layers.readers.readers`: which modules serve the feature, what one serves
   (read from the state its forward dispatches by), its report row, and optionally its expected
   count per stage and its optimizations entry (the metric label);
3. a known answer for a new kernel in :mod:`vllm_ling.ops.known_answer`, run by
   :mod:`.known_answers` where the kernel is found on the census;
4. a planted-divergence test (``tests/runtime/test_verification.py``): a module recording one
   choice and serving another must fail its row, named.
"""

from vllm_ling.runtime.verification.assembly import build_report
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.formatting import format_table
from vllm_ling.runtime.verification.once import verify_once
from vllm_ling.runtime.verification.policy import LingVerificationError, enforce_policy

__all__ = ["Check", "LingVerificationError", "build_report", "enforce_policy", "format_table", "verify_once"]
