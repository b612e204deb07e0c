"""A user's install: a wheel built from this repository, in a fresh virtualenv, used from a directory
outside the checkout with the user's own copy of run_translation.py (issue: the policies were read from the
checkout, so an installed plugin found none)."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import BIN, DATA, DEFAULT_MODEL, REPO, TRANSLATE_ARGS, once_per_run, run_in_process
from ds_inference_integration.run.ranks import free_port

pytestmark = pytest.mark.launched  # every test here starts processes (a wheel, a venv, a launcher)


@pytest.fixture
def wheel() -> Path:
    """The wheel of this repository, built once per pytest run for the tests below (`once_per_run`)."""

    def build(wheels: Path) -> None:
        wheels.mkdir()
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(wheels), str(REPO)], check=True, timeout=180, cwd=wheels, capture_output=True)

    return next(once_per_run("wheel", build).glob("ds_inference_integration-*.whl"))


def test_wheel_in_a_fresh_venv_lists_policies_and_predicts_at_tp2(tmp_path, wheel):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=180, capture_output=True)
    # the heavy dependencies (torch, transformers, deepspeed) come from this venv, as a path only: its
    # editable install of the package (a .pth hook) is not run, so the import below is the wheel's
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{BIN}:{os.environ['PATH']}", "PYTHONPATH": "",
           "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    where = subprocess.run([str(python), "-c", "import ds_inference_integration as d; print(d.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, check=True)
    assert str(site) in where.stdout, where.stdout

    # without any extra (their packages made unimportable, as where they are not installed), the library and the
    # command line import and list the policies
    from ds_inference_integration.extras import EXTRAS

    every_extra = sorted(p for packages in EXTRAS.values() for p in packages)
    none = f"import sys; sys.modules.update(dict.fromkeys({every_extra!r}));"
    listed = subprocess.run([str(python), "-c", none + "import ds_inference_integration.predict.trainer; "
                             "from ds_inference_integration.tools.cli import main; sys.exit(main(['policy', 'list']))"],
                            capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    served = subprocess.run([str(python), "-c", none + "from ds_inference_integration.tools.cli import main; "
                             f"sys.exit(main(['serve', {str(DEFAULT_MODEL)!r}, '--tp_size', '1']))"],
                            capture_output=True, text=True, cwd=work, env=env, timeout=120)
    lines = served.stderr.strip().splitlines()  # one line naming the extra (its first missing package named)
    assert served.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ds-inference serve") and \
        lines[0].endswith("is not installed; valid: pip install 'ds-inference-integration[serve]'"), served.stderr
    # and a user's run_translation.py at tp 2 with [metrics] and their own datasets: the [examples]-only and [bench]
    # packages are not there (a sitecustomize of the fresh venv makes them unimportable in every rank)
    (site / "sitecustomize.py").write_text("import sys\nsys.modules.update(dict.fromkeys(['matplotlib', 'scipy', "
                                           "'soundfile']))\n")
    blocked = subprocess.run([str(python), "-c", "import scipy"], capture_output=True, text=True, cwd=work, env=env)
    assert blocked.returncode != 0 and "import of scipy halted" in blocked.stderr, blocked.stderr[-500:]
    import tomllib

    shipped = {t for p in (REPO / "policies").glob("*.toml") for t in tomllib.loads(p.read_text())["model_types"]}
    assert {line.split()[0] for line in listed.stdout.splitlines()} == shipped

    script = work / "my_run_translation.py"  # the user's own copy, away from examples/
    shutil.copy(REPO / "examples" / "run_translation.py", script)
    args = ["--model_name_or_path", str(DEFAULT_MODEL), "--test_file", str(DATA / "test.json"), "--do_predict",
            "--max_predict_samples", "24", "--per_device_eval_batch_size", "8", *TRANSLATE_ARGS]
    tp = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                         str(free_port()), "--log-dir", str(tmp_path / "torchrun_logs"), str(script),
                         "--output_dir", str(work / "tp2"), *args,
                         "--deepspeed_inference", "--injection_policy", "auto"],
                        capture_output=True, text=True, cwd=work, env=env, timeout=240)
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    run_in_process(args, tmp_path / "single")
    assert (work / "tp2" / "generated_predictions.txt").read_text() == \
        (tmp_path / "single" / "generated_predictions.txt").read_text()


def test_tools_that_need_the_repository_examples_say_so_in_one_line(tmp_path, monkeypatch):
    """Installed from a wheel, examples/ is not there: the benchmark commands say which file and what to pass."""
    import logging

    import pytest

    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.tools import bench

    level = logging.getLogger("ds_inference_integration").level

    monkeypatch.setattr(bench, "RUN_TRANSLATION", tmp_path / "examples" / "run_translation.py")
    monkeypatch.setattr(bench, "REPO", tmp_path)
    with pytest.raises(InferenceSetupError, match=r"ds-inference bench guard needs examples/run_translation.py from "
                                                  r"the repository, which is not installed with the package"):
        bench.bench_guard(1, 2, tmp_path / "out.json")
    monkeypatch.setattr(bench, "DEFAULT_LM", tmp_path / "examples" / "models" / "gpt2")
    with pytest.raises(InferenceSetupError, match=r"ds-inference bench generation needs examples/models/gpt2 .*"
                                                  r"pass --model MODEL_DIR"):
        bench.bench_generation(None, None, [1], str(REPO / "examples" / "data" / "prompts.txt"), 4, 2,
                               tmp_path / "bench", ["generate_loop"])
    # called in a script's (here the tests') own process, the bench functions leave its logging alone: the
    # benches quiet repeated warnings in their own processes only (a test that ran after this one lost its logs)
    assert logging.getLogger("ds_inference_integration").level == level


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, tmp_path):
    """Without an extra's package the library says, in one line, which extra installs it: BLEU without sacrebleu
    ([metrics]), `ds-inference bench generation` without datasets ([examples]) or
    matplotlib ([bench], before any measurement), and the command line prints it as one `error:` line."""
    import pytest

    from ds_inference_integration.errors import InferenceSetupError
    from ds_inference_integration.predict import metrics

    for module in ("sacrebleu", "sacrebleu.metrics", "datasets", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError, as for a package not installed
    with pytest.raises(InferenceSetupError, match=r"^BLEU needs sacrebleu, which is not installed; valid: pip install "
                                                  r"'ds-inference-integration\[metrics\]'$"):
        metrics.CorpusBleu()
    # the command line, in its own process (the bench commands quiet the process's logging)
    blocked = "import sys; sys.modules.update(datasets=None, matplotlib=None); "
    proc = subprocess.run([sys.executable, "-c", blocked + "from ds_inference_integration.tools.cli import main; "
                           f"sys.exit(main(['bench', 'generation', '--output-dir', {str(tmp_path / 'bench')!r}]))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: ds-inference bench generation needs datasets, which is not installed; valid: "
        "pip install 'ds-inference-integration[examples]'"], proc.stderr[-2000:]


def test_the_wheel_requires_only_what_the_library_imports(wheel):
    """The built wheel's unconditional requirements are the core (torch, transformers, deepspeed, accelerate,
    safetensors, numpy); everything else is behind an extra, each extra installing the packages that
    `extras.EXTRAS` says it adds."""
    import re
    import zipfile

    from ds_inference_integration.extras import EXTRAS

    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires-Dist:")]

    def name(req):
        return re.split(r"[\s\[<>=;!~]", req, maxsplit=1)[0].lower().replace("-", "_")

    core = {name(r) for r in requires if "extra ==" not in r}
    assert core == {"torch", "transformers", "deepspeed", "accelerate", "safetensors", "numpy"}, core
    by_extra = {}
    for r in requires:
        if m := re.search(r'extra == "(\w+)"', r):
            by_extra.setdefault(m.group(1), set()).add(name(r))
    for extra, packages in EXTRAS.items():
        assert set(packages) <= by_extra[extra], (extra, by_extra.get(extra))
    assert "ds_inference_integration" in by_extra["examples"]  # [examples] brings [metrics] with it
