"""`loraplex kernels build`: builds the native kernel ahead of serving, or says it cannot and exits 1."""

import shutil
from pathlib import Path

from typer.testing import CliRunner

from app.cli import build_app
from deployments.engine.model import native_kernel


def test_build_names_the_kernel_already_built_without_building_again(tmp_path: Path) -> None:
    library = native_kernel.built_library()
    assert library is not None, "the session fixture builds it"
    cache = tmp_path / "kernels"
    shutil.copytree(library.parent, cache / library.parent.name)
    result = CliRunner().invoke(
        build_app(), ["kernels", "build"], env={"LORAPLEX_KERNEL_CACHE": str(cache), "CXX": "/bin/false"}
    )
    assert result.exit_code == 0, result.output
    assert str(cache / library.parent.name / library.name) in result.output.replace("\n", "")


def test_build_without_a_working_compiler_exits_1_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    env = {"LORAPLEX_KERNEL_CACHE": str(cache), "CXX": "/bin/false", "CC": "/bin/false"}
    result = CliRunner().invoke(build_app(), ["kernels", "build"], env=env)
    assert result.exit_code == 1, result.output
    assert "could not be built" in result.output
    assert list(cache.iterdir()) == []
