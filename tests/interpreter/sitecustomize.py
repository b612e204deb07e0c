"""Read first by every Python process the suite starts (conftest.py puts this directory on PYTHONPATH; the fault
hook's sitecustomize, which shadows this one where a test sets it, runs this file first).

Python's collector at its default thresholds (700, 10, 10) ran ~1,100 young, ~100 middle and 8 full collections
while a rank imported its stack: `import transformers.trainer, deepspeed, datasets` cost 6.2 CPU-s at the default,
5.6 at (7000, 10, 10) and 5.3 with the collector off (four runs each, alternately, 2026-12-06). The suite starts
~150 such processes on 2 cores and is CPU-bound: the launched tests of test_translation_tp, test_generation,
test_trainer and test_policies_tp (`pytest -n 2`, alternately, twice) took 226 and 245 CPU-s (123 and 134 s) at the
default, 212 and 231 (113 and 121 s) at (7000, 10, 10). The collector stays on (a server's memory given back, the
teardown checks); it runs a tenth as often. The ranks the package forks itself import their stack with it off
(`run/template.py`); a user's launcher's ranks run at the user's interpreter's settings, which the wheel's test
keeps (it clears PYTHONPATH).
"""

import gc

gc.set_threshold(7000, 10, 10)

