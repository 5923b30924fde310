"""Git sources: refs resolved to commits, cell ids, PR mode's change, and bad input in one line."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from deepspeed_repo import git
from helpers import run_cli

from dsmatrix.build.sources import changed_diff, resolve, source_tarball
from dsmatrix.build.wheels import unpack_sdist
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import BuildError, ConfigError, UnknownVersionError
from dsmatrix.plan.cells import make_cell
from dsmatrix.plan.git_source import GitSource, split_spec


def test_refs_resolve_to_commits(fake_repo: Path, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    base, fix = git(fake_repo, "rev-parse", "master"), git(fake_repo, "rev-parse", "fix")
    assert resolve(f"git:{fake_repo}@master", cache, "--deepspeed").commit == base
    assert resolve(f"git:{fake_repo}@v0.19.6", cache, "--deepspeed").commit == base
    assert resolve(f"git:{fake_repo}", cache, "--deepspeed").commit == base  # HEAD
    assert resolve(f"git:{fake_repo}@{fix[:12]}", cache, "--deepspeed").commit == fix
    pr = resolve(f"git:{fake_repo}@refs/pull/7/head", cache, "--deepspeed")  # outside heads and tags: fetched by name
    assert (pr.commit, pr.version, pr.tag) == (fix, "0.19.6", f"refs_pull_7_head.{fix[:10]}")


def test_cell_names_ref_and_commit_and_keeps_the_version(fake_repo: Path, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    base = resolve(f"git:{fake_repo}@master", cache, "--deepspeed")
    cell = make_cell("3.11", "2.13.0+cpu", GitSource(base))
    assert cell.deepspeed == "0.19.6" and cell.source_key == f"git-{base.commit}"
    assert cell.id == f"py3.11-torch2.13.0+cpu-ds0.19.6-git.master.{base.short}"
    assert cell.label == f"matrix(py3.11, torch2.13.0+cpu, ds0.19.6 git master@{base.short})"
    head = resolve(f"git:{fake_repo}@fix", cache, "--head")
    pr = make_cell("3.11", "2.13.0+cpu", GitSource(base, head))
    assert pr.id.endswith(f"-pr.master.{base.short}..fix.{head.short}")
    assert pr.values()["deepspeed_source"] == f"git-{base.commit}..{head.commit}"


def test_tarball_is_the_commit_tree_and_the_change_is_the_diff(fake_repo: Path, tmp_path: Path) -> None:
    import tarfile

    cache = Cache(tmp_path / "cache")
    base = resolve(f"git:{fake_repo}@master", cache, "--deepspeed")
    head = resolve(f"git:{fake_repo}@fix", cache, "--head")
    with tarfile.open(source_tarball(head, cache)) as tar:
        names = tar.getnames()
        member = tar.extractfile(f"deepspeed-{head.short}/deepspeed/coordinator.py")
        assert member is not None and b"cache = {}" in member.read()
    assert f"deepspeed-{head.short}/version.txt" in names
    diff = changed_diff(GitSource(base, head), cache)
    assert "+    cache = {}" in diff and "deepspeed/coordinator.py" in diff


def test_bad_git_sources_say_what_is_wrong(fake_repo: Path, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    with pytest.raises(UnknownVersionError, match="no such branch, tag, ref or commit"):
        resolve(f"git:{fake_repo}@no-such-branch", cache, "--deepspeed")
    with pytest.raises(UnknownVersionError, match="does not exist"):
        resolve(f"git:{tmp_path}/nowhere@master", cache, "--deepspeed")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UnknownVersionError, match="cannot fetch"):
        resolve(f"git:{plain}@master", cache, "--deepspeed")
    git(fake_repo, "checkout", "-qb", "not-deepspeed")
    git(fake_repo, "rm", "-q", "version.txt")
    git(fake_repo, "commit", "-qm", "drop version")
    with pytest.raises(UnknownVersionError, match="is not a DeepSpeed source: no version.txt"):
        resolve(f"git:{fake_repo}@not-deepspeed", cache, "--deepspeed")
    with pytest.raises(ConfigError, match="say which repository"):
        split_spec("git:@master", "--deepspeed")


def test_scp_style_urls_keep_their_at_sign() -> None:
    scp = "git@github.com:deepspeedai/DeepSpeed.git"
    assert split_spec(f"git:{scp}", "x") == (scp, "")
    assert split_spec(f"git:{scp}@v0.19.6", "x") == (scp, "v0.19.6")
    assert split_spec("git:https://github.com/deepspeedai/DeepSpeed@refs/pull/1/head", "x")[1] == "refs/pull/1/head"


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--head", "fix"], "--head needs exactly one --deepspeed value, the repository"),
        (["--deepspeed", "0.19.8", "--head", "fix"], "--head needs exactly one --deepspeed value"),
        (["--deepspeed", "git:{repo}", "--base", "master"], "--base needs --head"),
        (["--deepspeed", "git:{repo}@master", "--base", "master", "--head", "fix"], "give the base ref once"),
        (["--deepspeed", "git:{repo}", "--base", "master", "--head", "v0.19.6"], "are the same commit"),
        (["--deepspeed", "git:{repo}@nope"], "git:{repo}@nope: no such branch, tag, ref or commit"),
        (["--deepspeed", "git:{repo}@fix", "--platform", "linux/arm64"], "git sources run on this machine's platform"),
        (["--deepspeed", "git:{repo}", "--base", "master", "--head", "fix", "--patch", "x.diff"], "PR mode applies no diff"),
    ],
)
def test_git_bad_input_is_one_line(fake_repo: Path, tmp_path: Path, args: list[str], expect: str) -> None:
    args = [a.replace("{repo}", str(fake_repo)) for a in args]
    where = ["--cache-dir", str(tmp_path / "cache"), "--results", str(tmp_path / "r")]
    proc = run_cli("matrix", "--tier", "smoke", *where, *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode in (2, 4, 6), proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dsmatrix: error: "), proc.stderr
    assert expect.replace("{repo}", str(fake_repo)) in lines[0], lines[0]
    assert not (tmp_path / "r").exists()


def test_plan_of_a_pr(fake_repo: Path, tmp_path: Path) -> None:
    import json

    args = ["--deepspeed", f"git:{fake_repo}", "--base", "master", "--head", "refs/pull/7/head", "--plan", "--json"]
    proc = run_cli("matrix", "--tier", "smoke", "--cache-dir", str(tmp_path / "cache"), *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (cell,) = json.loads(proc.stdout)["include"]
    assert cell["deepspeed"] == "0.19.6" and cell["git"]["head"]["ref"] == "refs/pull/7/head"
    assert "-pr.master." in cell["id"] and "..refs_pull_7_head." in cell["id"]


INJECTIONS = [
    ["--deepspeed", "git:{repo}@--upload-pack=touch {marker};#"],
    ["--deepspeed", "git:--upload-pack=touch {marker};#://x"],
    ["--deepspeed", "git:{repo}", "--base", "master", "--head", "--upload-pack=touch {marker};#"],
    ["--deepspeed", "git:{repo}", "--base", "--upload-pack=touch {marker};#", "--head", "fix"],
    ["--deepspeed", "git:{repo}@a:b"],
    ["--deepspeed", "git:{repo}", "--base", "master", "--head", "a:b"],
    ["--deepspeed", "git:ext::sh -c touch% {marker}"],
    ["--deepspeed", "git:ssh://-oProxyCommand=touch {marker}/x"],
    ["--deepspeed", "git:git@-oProxyCommand=touch {marker}:x"],
]


@pytest.mark.parametrize("args", INJECTIONS, ids=[" ".join(a)[:60] for a in INJECTIONS])
def test_a_ref_or_location_never_becomes_a_git_option(fake_repo: Path, tmp_path: Path, args: list[str]) -> None:
    """Refs and locations are checked before any git call (git's ref format, no leading '-', no
    refspec ':', URL schemes and hosts): one line, exit 2, and the injected command never ran."""
    marker = tmp_path / "INJECTED"
    args = [a.replace("{repo}", str(fake_repo)).replace("{marker}", str(marker)) for a in args]
    where = ["--cache-dir", str(tmp_path / "cache"), "--results", str(tmp_path / "r")]
    proc = run_cli("matrix", "--tier", "smoke", *where, *args, "--plan", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dsmatrix: error: "), proc.stderr
    assert not marker.exists(), "the injected command ran"
    assert not (tmp_path / "cache" / "git").exists(), "nothing was fetched for a refused ref"


@pytest.mark.parametrize(
    ("ref", "fine"),
    [
        ("master", True),
        ("v0.19.6", True),
        ("refs/pull/7/head", True),
        ("HEAD", True),
        ("edaa72212", True),
        ("-x", False),
        ("a:b", False),
        ("a..b", False),
        ("a b", False),
        ("a~1", False),
        ("a^", False),
        ("a?", False),
        ("a*", False),
        ("a[", False),
        ("a\\b", False),
        ("@", False),
        ("a@{1}", False),
        ("/a", False),
        ("a/", False),
        ("a//b", False),
        ("a.", False),
        (".a", False),
        ("a/.b", False),
        ("a.lock", False),
        ("a/b.lock/c", False),
        ("a\nb", False),
        ("", False),
    ],
)
def test_ref_rules_are_gits_own(ref: str, fine: bool, tmp_path: Path) -> None:
    """``ref_problem`` agrees with ``git check-ref-format --allow-onelevel`` (where git can be asked:
    a leading '-' and an empty ref are refused before git sees them)."""
    import subprocess

    from dsmatrix.plan.git_source import ref_problem

    assert (ref_problem(ref) is None) == fine, ref_problem(ref)
    if ref and not ref.startswith("-"):
        git_says = subprocess.run(["git", "check-ref-format", "--allow-onelevel", ref], capture_output=True).returncode == 0
        assert git_says == fine or ref == "HEAD", f"git check-ref-format says {git_says} for {ref!r}"


def test_a_version_txt_that_is_not_a_version_is_refused(fake_repo: Path, tmp_path: Path) -> None:
    for text in ("../../etc", "9" * 5000, "0.19.6\nrm -rf /", "v0.19.6"):
        git(fake_repo, "checkout", "-q", "master")
        git(fake_repo, "checkout", "-qB", "odd")
        (fake_repo / "version.txt").write_text(text + "\n")
        git(fake_repo, "commit", "-qam", "odd version")
        with pytest.raises(UnknownVersionError, match=r"version\.txt .* is not a DeepSpeed version such as 0\.19\.8") as raised:
            resolve(f"git:{fake_repo}@odd", Cache(tmp_path / "cache"), "--deepspeed")
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("shape", ["two top folders", "a link out", "not a tar"])
def test_an_archive_that_is_not_one_safe_source_folder_is_a_one_line_build_error(tmp_path: Path, shape: str) -> None:
    """An sdist or git archive unpacks to exactly one folder, every member inside it (tar's data filter)."""
    archive = tmp_path / "deepspeed-0.19.8.tar.gz"
    if shape == "not a tar":
        archive.write_bytes(b"\x1f\x8b broken")
    else:
        members = [tarfile.TarInfo("deepspeed-0.19.8/setup.py")]
        if shape == "two top folders":
            members.append(tarfile.TarInfo("other/setup.py"))
        else:
            members.append(tarfile.TarInfo("deepspeed-0.19.8/escape"))
            members[-1].type, members[-1].linkname = tarfile.SYMTYPE, "../../../etc"
        with tarfile.open(archive, "w:gz") as tar:
            for member in members:
                tar.addfile(member, io.BytesIO(b""))
    with pytest.raises(BuildError) as info:
        unpack_sdist(archive, tmp_path / "unpacked")
    message = str(info.value)
    assert message.startswith("deepspeed-0.19.8.tar.gz: ") and "\n" not in message, message
    assert {"two top folders": "holds 2 top-level entries", "a link out": "cannot unpack", "not a tar": "cannot unpack"}[shape] in message
