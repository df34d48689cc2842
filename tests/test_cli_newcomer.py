"""The `gemmgen` command as a new user meets it: printed build commands that work when pasted, one-line
errors, builds found from any working directory, arguments checked before the GPU, empty shapes,
invalid regexes, --version and help text for every command and option."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil

import pytest
import torch

from conftest import make_entry, run_cli, write_build_dir
from gemmgen import __version__, cache
from gemmgen.cli import app
from gemmgen.errors import GemmgenError, InputError
from gemmgen.generator import manifest, space
from gemmgen.select import device, registry
from gemmgen.select.problem import Problem

H100 = device.synthetic((9, 0), 132)
A100 = device.synthetic((8, 0), 108)
RTX = device.synthetic((8, 6), 84)  # 99 KB of shared memory per block: d256's default tile does not fit
INSTANCE = next(i for i in space.family_named("fa2_sm80").DEFAULT if i.params()["dtype"] == "bf16")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory without ./build, the default build directories and no GEMMGEN_BUILD_DIR."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("GEMMGEN_BUILD_DIR", raising=False)
    registry.set_build_dirs(None)
    yield work
    registry.set_build_dirs(None)


def built_names(out: pathlib.Path) -> set[str]:
    """The instance names of every manifest under `out`."""
    return {e.name for path in registry.manifest_paths(out) for e in manifest.load(path).instances}


def paste(command: str, *extra: str) -> int:
    """Run a printed `gemmgen ...` command line through the CLI's own parsing, with `extra` arguments."""
    words = shlex.split(command)
    assert words[0] == "gemmgen", command
    return app.main(words[1:] + list(extra))


# 1. Printed build commands work when pasted.

@pytest.mark.parametrize("problem, family", [
    (Problem("bf16", 80, False, H100), "mea_sm80"),
    (Problem("fp16", 80, False, A100), "mea_sm80"),
    (Problem("bf16", 80, True, A100), "mea_sm80"),
    (Problem("fp16", 64, True, A100), "fa2_sm80"),
    (Problem("bf16", 128, False, H100, dropout=True), "fmha_sm90"),  # its `_dropout` instances
    (Problem("bf16", 96, False, H100, dropout=True), "mea_sm80"),
    (Problem("fp16", 128, True, A100, dropout=True), "mea_sm80"),
    (Problem("bf16", 256, False, RTX), "fa2_sm80"),  # not in the default set: needs --all
], ids=lambda v: v.describe() if isinstance(v, Problem) else v)
def test_printed_build_command_builds_exactly_the_target(here, tmp_path, capsys, problem, family):
    arch, target = registry.build_target(problem)
    assert target.family == family
    command = registry.build_command(problem)
    assert f"--family {family}" in command
    assert ("--all" in command.split()) == (target not in space.family_named(family).DEFAULT)
    out = tmp_path / "out"
    assert paste(command, "--no-compile", "--out", str(out)) == 0, capsys.readouterr().err
    assert built_names(out) == {target.name}
    assert (out / arch.value / manifest.MANIFEST_NAME).is_file()


def test_explain_prints_a_command_that_builds_the_instance_it_needs(here, tmp_path, capsys):
    # Head dim 80 has no tile: the call runs padded to 96, so the command builds a d96 instance.
    status = app.main(["explain", "--shape", "1,8,1024,1024,80", "--cc", "9.0", "--sms", "132",
                       "--dtype", "bf16"])
    captured = capsys.readouterr()
    assert status == 1 and "head_dim=96" in captured.err
    command = captured.err.rstrip().splitlines()[-1].removeprefix("Build one with: ")
    assert command.startswith("gemmgen generate --arch sm80") and "--family fa2_sm80" in command
    out = tmp_path / "out"
    assert paste(command, "--no-compile", "--out", str(out)) == 0, capsys.readouterr().err
    (name,) = built_names(out)
    assert name.startswith("fa2_sm80_bf16_d96_none_")


def test_every_instance_has_a_command_selecting_it_alone():
    for family in space.FAMILIES:
        for arch in family.ARCHS:
            for inst in family.SPACE:
                command = registry.generate_command(arch, family.FAMILY, inst.name, inst in family.DEFAULT)
                args = app.parser().parse_args(shlex.split(command)[1:])
                assert args.func is app.cmd_generate and args.arch == [arch.value]
                chosen = space.select_instances(arch, all_instances=args.all, pattern=args.filter,
                                                families=app.generate_families(args.family))
                assert [i.name for i in chosen] == [inst.name], command


def test_generate_command_anchors_a_name_that_is_part_of_another():
    names = [i.name for i in space.family_named("fmha_sm90").SPACE]
    part = next(n for n in names if any(n != m and n in m for m in names))
    command = registry.generate_command("sm90", "fmha_sm90", part, False)
    assert f"--filter '^{part}$'" in command and command.endswith("--family fmha_sm90 --all")
    assert registry.generate_command("sm80", "fa2_sm80", INSTANCE.name, True) == (
        f"gemmgen generate --arch sm80 --filter {INSTANCE.name} --family fa2_sm80")


def test_build_command_writes_into_the_given_build_dir(here, tmp_path):
    registry.set_build_dirs([tmp_path / "my builds"])
    command = registry.build_command(Problem("bf16", 80, False, H100))
    assert f"--out '{tmp_path / 'my builds'}'" in command
    assert shlex.split(command)[shlex.split(command).index("--out") + 1] == str(tmp_path / "my builds")


# 2. One-line errors.

def test_generate_into_a_folder_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_cli("generate", "--arch", "sm80", "--no-compile", "--out", str(blocker / "b"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"cannot write the build folder {blocker / 'b'}: Not a directory" in proc.stderr


def test_generate_into_a_read_only_folder(here, tmp_path, monkeypatch, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mkdir = pathlib.Path.mkdir

    def refuse(self, *args, **kwargs):  # as a read-only folder does, whoever runs the test
        if self.parent == read_only:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    status = app.main(["generate", "--arch", "sm80", "--no-compile", "--out", str(read_only / "b")])
    err = capsys.readouterr().err
    assert status == 1
    assert err == f"gemmgen: error: cannot write the build folder {read_only / 'b'}: Permission denied\n"
    assert cache.recorded_builds() == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_generate_into_a_chmod_read_only_folder(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        proc = run_cli("generate", "--arch", "sm80", "--no-compile", "--out", str(read_only / "b"))
    finally:
        read_only.chmod(0o755)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"cannot write the build folder {read_only / 'b'}: Permission denied" in proc.stderr


@pytest.mark.parametrize("error, status, message", [
    (OSError(28, "No space left on device", "/data/x.json"), 1, "/data/x.json: No space left on device"),
    (PermissionError(13, "Permission denied", "/a", None, "/b"), 1, "/a -> /b: Permission denied"),
    (OSError("plain\ntext"), 1, "plain text"),
    (GemmgenError("it broke"), 1, "it broke"),
    (InputError("bad argument"), 2, "bad argument"),
])
def test_top_level_errors_are_one_message(monkeypatch, capsys, error, status, message):
    def fail(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(app, "cmd_list", fail)
    assert app.main(["list"]) == status
    assert capsys.readouterr().err == f"gemmgen: error: {message}\n"


# 3. Builds are found from any working directory.

def generate(out: str | os.PathLike, *extra: str) -> int:
    return app.main(["generate", "--arch", "sm80", "--filter", INSTANCE.name, "--no-compile", "--out", str(out),
                     *extra])


def test_generate_records_its_folder_and_the_registry_finds_it_elsewhere(here, tmp_path, monkeypatch, capsys):
    assert generate("out") == 0
    printed = capsys.readouterr().out
    assert f"build folder: {here / 'out'}\n" in printed
    assert cache.recorded_builds() == [here / "out"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    registry.refresh()
    assert registry.search_dirs() == [pathlib.Path("build"), here / "out", registry.jit_dir()]
    assert [c.name for c in registry.load()[0]] == [INSTANCE.name]
    assert registry.load()[0][0].build_dir == here / "out" / "sm80"


def test_records_are_deduplicated_most_recent_first_and_pruned(here, tmp_path, capsys):
    for out in ("a", str(here / "a"), "b", "a/../b", "c"):
        assert generate(out) == 0
    assert cache.recorded_builds() == [here / "c", here / "b", here / "a"]
    shutil.rmtree(here / "b")
    assert cache.recorded_builds() == [here / "c", here / "a"]  # gone: no longer searched
    assert generate("a") == 0
    data = json.loads(cache.builds_path().read_text())
    assert [b["path"] for b in data["builds"]] == [str(here / "a"), str(here / "c")]  # and dropped


def test_build_of_this_directory_is_searched_once(here, capsys):
    assert generate("build") == 0
    assert cache.recorded_builds() == [here / "build"]
    assert registry.search_dirs() == [pathlib.Path("build"), registry.jit_dir()]
    assert len(registry.load()[0]) == 1


def test_explicit_build_dirs_are_the_only_ones_searched(here, tmp_path, monkeypatch, capsys):
    assert generate("out") == 0
    mine = write_build_dir(tmp_path / "mine", [make_entry(INSTANCE)])
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(mine))
    registry.refresh()
    assert registry.search_dirs() == [mine, registry.jit_dir()]
    assert [c.build_dir for c in registry.load()[0]] == [mine / "sm80"]
    monkeypatch.delenv("GEMMGEN_BUILD_DIR")
    registry.set_build_dirs([mine])
    assert registry.search_dirs() == [mine, registry.jit_dir()]
    registry.set_build_dirs(None)
    assert here / "out" in registry.search_dirs()


def test_generate_says_when_gemmgen_build_dir_hides_the_build(here, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(tmp_path / "elsewhere"))
    assert generate("out") == 0
    assert f"GEMMGEN_BUILD_DIR is set and does not name {here / 'out'}" in capsys.readouterr().err
    monkeypatch.setenv("GEMMGEN_BUILD_DIR", str(here / "out"))
    assert generate("out") == 0
    assert "GEMMGEN_BUILD_DIR" not in capsys.readouterr().err


def test_unreadable_record_counts_as_none_and_is_rewritten(here, capsys):
    cache.writable_dir()
    cache.builds_path().write_text("{not json")
    assert cache.recorded_builds() == []
    assert generate("out") == 0
    assert cache.recorded_builds() == [here / "out"]


def test_unwritable_cache_warns_but_builds(here, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GEMMGEN_CACHE_DIR", str(blocker / "cache"))
    assert generate("out") == 0
    err = capsys.readouterr().err
    assert "gemmgen: warning: cache directory" in err and "is not writable" in err
    assert built_names(here / "out") == {INSTANCE.name}


def test_list_shows_every_known_build(here, tmp_path, monkeypatch, capsys):
    assert app.main(["list"]) == 1
    assert "no builds found (searched" in capsys.readouterr().err
    assert generate(tmp_path / "one") == 0
    assert app.main(["generate", "--arch", "sm80", "--arch", "sm90", "--no-compile", "--out", "two"]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert app.main(["list"]) == 0
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["folder", "arch", "instances", "states"]
    assert [str(here / "two"), "sm80", "86", "86 rendered"] in rows
    assert [str(here / "two"), "sm90", "122", "122 rendered"] in rows
    assert [str(tmp_path / "one"), "sm80", "1", "1 rendered"] in rows
    assert app.main(["list", "--out", str(tmp_path / "one")]) == 0
    assert INSTANCE.name in capsys.readouterr().out


# 4. Arguments before the GPU, empty shapes, invalid regexes, --version.

@pytest.mark.parametrize("args, message", [
    (("--batch", "0"), "--batch must be at least 1, got 0"),
    (("--heads", "-2"), "--heads must be at least 1, got -2"),
    (("--seq-len", "0"), "--seq-len must be at least 1, got 0"),
    (("--seq-len-k", "0"), "--seq-len-k must be at least 1, got 0"),
    (("--heads", "12", "--heads-kv", "5"), "--heads-kv 5 must divide --heads 12"),
    (("--head-dim", "7"), "--head-dim 7 is not supported; supported: "),
    (("--iters", "0"), "--iters must be at least 1, got 0"),
])
def test_run_checks_its_arguments_before_the_gpu(args, message):
    proc = run_cli("run", *args)
    assert proc.returncode == 2 and proc.stderr.startswith(f"gemmgen: error: {message}")
    assert proc.stderr.count("\n") == 1 and "CUDA" not in proc.stderr


@NO_GPU
def test_run_with_good_arguments_needs_the_gpu():
    proc = run_cli("run", "--batch", "1", "--heads", "2", "--seq-len", "17")
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        app.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"gemmgen {__version__}\n"


@pytest.mark.parametrize("shape, words", [
    ("1,8,0,1024,128", ["shape: B=1 H=8 Nq=0 Nk=1024 d=128 bf16",
                        "empty problem (Nq = 0): O [1, 8, 0, 128] and the LSE [1, 8, 0] have no elements",
                        "without selecting an instance or launching a kernel"]),
    ("0,16,64,64", ["shape: B=0 H=16 Nq=Nk=64 d=64 bf16", "empty problem (B = 0)"]),
    ("2,4,100,0,64,causal", ["Nq=100 Nk=0 d=64 bf16 causal",
                             "no keys (Nk = 0): every row of O [2, 4, 100, 64] is 0 and its LSE is -inf"]),
])
def test_explain_an_empty_shape(shape, words, capsys):
    assert app.main(["explain", "--shape", shape]) == 0  # no GPU and no --cc needed: nothing would run
    out = capsys.readouterr().out
    for w in words:
        assert w in out


@pytest.mark.parametrize("args, message", [
    (("--shape", "2,16,64,0"), "head dim 0 in shape '2,16,64,0': it must be positive"),
    (("--shape", "2,0,64,64"), "key/value heads 0 (--heads-kv, default H) must be at least 1 and divide H = 0"),
    (("--shape", "2,8,0,64,300"), "head dim 300 is not supported; supported: from 1 to 256"),
])
def test_explain_empty_shape_errors(args, message, capsys):
    assert app.main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Shape(" not in err and err.count("\n") == 1


def test_profile_zero_size_is_a_clear_error(capsys):
    assert app.main(["profile", "--arch", "sm80", "--shapes", "2,16,0,64"]) == 2
    err = capsys.readouterr().err
    assert "sizes must be positive in shape '2,16,0,64'" in err and "Shape(" not in err


@pytest.mark.parametrize("pattern", ["(", "d64[", "*x"])
def test_invalid_filter_regex(pattern, capsys):
    assert app.main(["generate", "--arch", "sm80", "--no-compile", "--filter", pattern, "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemmgen: error: invalid regex {pattern!r} : ") and err.count("\n") == 1
    assert not pathlib.Path("unused").exists()


# 5. Help text for every command and option.

def parsers(parser: argparse.ArgumentParser, path: str = "gemmgen"):
    """(command path, parser) for the parser and every sub-command under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            for name, sub in action.choices.items():
                assert name in helped, f"`{path} {name}` has no help text"
                yield from parsers(sub, f"{path} {name}")


def test_every_command_and_option_has_help():
    seen = 0
    for path, parser in parsers(app.parser()):
        assert parser.description, f"`{path}` has no description"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"`{path}` {name} has no help text"
            seen += 1
    assert seen > 60


def test_help_texts_print(capsys):
    for path, _ in parsers(app.parser()):
        with pytest.raises(SystemExit) as info:
            app.main([*path.split()[1:], "--help"])
        assert info.value.code == 0
    out = capsys.readouterr().out
    assert "batch size B" in out and "--version" in out
