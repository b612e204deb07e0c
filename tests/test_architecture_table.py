"""The architecture table (docs/policies.md): written by `ds-inference policy matrix` (its full run is `make test-all`'s),
read here in this process: one row per architecture of the zoo, each passing at tp 2 and 4, and the table
built from reports the way the command builds it."""

from pathlib import Path

from ds_inference_integration.tools.architecture_zoo import TABLE_END, TABLE_START, ZOO, table, write_readme

README = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def test_the_readme_table_has_a_passing_row_for_every_architecture_of_the_zoo():
    """A zoo changed without running the matrix again leaves the README behind: this fails, naming the rows."""
    block = README.read_text(encoding="utf-8").split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    rows = [line.split(" | ") for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0].removeprefix("| ") for r in rows] == list(ZOO)
    failing = [r[0] for r in rows if not (r[3].startswith("pass (") and r[4].startswith("pass ("))]
    assert not failing, f"rerun `ds-inference policy matrix --readme docs/policies.md`; not passing: {failing}"
    assert len(ZOO) >= 40 and len({r[1] for r in rows}) >= 40  # forty model types at least


def _record(model, check, passed, **data):
    return {"model": model, "check": check, "passed": passed, "data": data}


def test_the_table_is_built_from_the_reports():
    checks = ["logits", "hidden_states", "greedy", "beam", "sample", "loading_shard-aware", "loading_pre-sharded"]
    good = [_record("gpt2", c, True) for c in checks] + [_record(
        "gpt2", "weights_per_rank", True, shares=[0.5, 0.5], policy="shipped gpt2.toml", model_type="gpt2")]
    bad = [_record("gpt2", c, c != "beam") for c in checks] + [_record(
        "gpt2", "weights_per_rank", True, shares=[0.25] * 4, policy="shipped gpt2.toml", model_type="gpt2")]
    text = table({2: {"checks": good}, 4: {"checks": bad}})
    row = next(line for line in text.splitlines() if line.startswith("| gpt2 |"))
    assert row == "| gpt2 | gpt2 | shipped gpt2.toml | pass (50% per rank) | FAIL (7/8 checks) |"
    assert "| phi3 | | | not run | not run |" in text  # in the zoo, not in these reports


def test_the_readme_block_is_replaced_between_its_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{TABLE_START}\nold table\n{TABLE_END}\nb\n")
    write_readme(readme, "| new |\n")
    assert readme.read_text() == f"a\n{TABLE_START}\n| new |\n{TABLE_END}\nb\n"


def test_the_matrix_command_refuses_bad_input_in_one_line(capsys):
    from ds_inference_integration.tools.cli import main

    assert main(["policy", "matrix", "--only", "gpt2,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only 'nope' is not in the zoo; valid: gpt2, ") and err.count("\n") == 1
    assert main(["policy", "matrix", "--tp-sizes", "1"]) == 2
    assert capsys.readouterr().err == "error: --tp-sizes '1' is invalid: tp sizes of 2 or more, e.g. 2,4\n"
