"""Packaging: the torch range pyproject.toml declares is the one zpp_compile checks at import; an
untested torch warns, one lacking a private API zpp_compile needs fails with an ImportError that
names it; zpp_compile's own calls raise no deprecation warnings."""

from __future__ import annotations

import traceback
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import typing_extensions
from packaging.requirements import Requirement
from packaging.version import Version

import zpp_compile
from zpp_compile import compat, schedule_check

from .models import batch, build, loss_of

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(requirements: list[str], name: str) -> Requirement:
    (found,) = [r for r in map(Requirement, requirements) if r.name == name]
    return found


def test_pyproject_bounds_torch_to_the_tested_range_which_includes_the_running_torch():
    torch_req = _requirement(_pyproject()["project"]["dependencies"], "torch")
    assert torch_req.specifier == Requirement(f"torch{compat.SUPPORTED_TORCH}").specifier
    assert Version(Version(torch.__version__).base_version) in torch_req.specifier, torch.__version__
    for tested in compat.TESTED_TORCH_VERSIONS:
        assert Version(tested) in torch_req.specifier and compat.untested_torch_message(tested) is None
    assert Version("2.11.0") not in torch_req.specifier and Version("2.14.0") not in torch_req.specifier


def test_triton_is_required_only_on_linux():
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra in ("gpu", "test"):
        triton = _requirement(extras[extra], "triton")
        assert triton.marker is not None
        assert triton.marker.evaluate({"sys_platform": "linux"})
        assert not triton.marker.evaluate({"sys_platform": "darwin"})
        assert not triton.marker.evaluate({"sys_platform": "win32"})


def test_the_license_file_is_declared_and_present():
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+git1234"])
def test_the_tested_torch_imports_without_a_warning(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.14.0", "2.12.1+cu126", "3.0.0"])
def test_an_untested_torch_warns_naming_the_installed_and_the_tested_versions(version):
    with pytest.warns(compat.UntestedTorchWarning) as caught:
        compat.check_torch(version)
    (message,) = [str(w.message) for w in caught]
    assert f"torch {version} is installed" in message, message
    assert "torch>=2.13,<2.14 (2.13.0)" in message and "pip install 'torch>=2.13,<2.14'" in message, message


def _fake_torch_2_11(name: str) -> types.ModuleType:
    """import_module of a torch that lacks optimization_hint (torch 2.11) and one private module."""
    if name == "torch._inductor.fx_passes.bucketing":
        raise ModuleNotFoundError(f"No module named {name!r}")
    module = types.ModuleType(name)
    if name != "torch.fx.experimental.symbolic_shapes":
        for attribute in compat.PRIVATE_APIS.get(name, ()):
            setattr(module, attribute, object())
    return module


def test_a_torch_lacking_a_private_api_fails_at_import_naming_the_symbol():
    with pytest.raises(ImportError) as raised:
        compat.check_torch("2.11.0", import_module=_fake_torch_2_11)
    message = str(raised.value)
    # The first missing one, in PRIVATE_APIS' order (bucketing comes before symbolic_shapes).
    assert "zpp_compile needs torch._inductor.fx_passes.bucketing (ModuleNotFoundError" in message, message
    assert "the installed torch 2.11.0" in message and "supports torch>=2.13,<2.14" in message, message
    only_the_hint = {"torch.fx.experimental.symbolic_shapes": ("optimization_hint",)}
    with pytest.raises(
        ImportError,
        match="needs torch.fx.experimental.symbolic_shapes.optimization_hint, which the installed torch 2.11.0",
    ):
        compat.check_torch("2.11.0", apis=only_the_hint, import_module=_fake_torch_2_11)


def test_the_running_torch_has_every_private_api():
    assert compat.missing_private_api(compat.PRIVATE_APIS) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own DeprecationWarnings while importing Inductor
        assert compat.missing_private_api(compat.LAZY_PRIVATE_APIS) is None


class _DeprecationsOfOurs:
    """Records each DeprecationWarning/FutureWarning whose deprecated API was called by
    zpp_compile: walking out from where it was raised, past torch's frames (the deprecated
    function and its wrappers, such as c10d_logger's, which move the warning's own location
    into torch), the first frame is zpp_compile's. A deprecation torch raises while importing
    its own modules has importlib frames there instead, and one raised by user code its own.
    (pytest's `error::FutureWarning:zpp_compile` filter sees only the warning's location.)"""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._package = str(Path(zpp_compile.__file__).parent)
        # torch's package, warnings.py, and typing_extensions' @deprecated wrapper
        self._skipped = (str(Path(torch.__file__).parent), warnings.__file__, typing_extensions.__file__)

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, (DeprecationWarning, FutureWarning)):
            return
        for frame in reversed(traceback.extract_stack()[:-1]):  # innermost first, without this one
            if frame.filename.startswith(self._skipped):
                continue
            if frame.filename.startswith(self._package):
                self.found.append(f"{frame.filename}:{frame.lineno}: {category.__name__}: {message}")
            return


def one_step_of_everything(folder: str, deprecated_gather: bool = False) -> list[str]:
    """Eager and compiled steps (qwZ + qgZ with error feedback), clipping, a checkpoint saved and
    loaded, full_state_dict: the deprecation warnings of zpp_compile's own calls.
    deprecated_gather=True: one eager step whose schedule check calls torch's deprecated
    all_gather_into_tensor (what compat.py avoids), to show that the detection works."""
    if deprecated_gather:
        schedule_check.all_gather_single = dist.all_gather_into_tensor
    try:
        return _run_everything(folder, deprecated_gather)
    finally:
        schedule_check.all_gather_single = compat.all_gather_single


def _run_everything(folder: str, only_eager: bool) -> list[str]:
    torch.manual_seed(0)
    config = zpp_compile.Config(
        quantize_weights=True, quantize_gradients=True, qgz_error_feedback=True, lowering="aot_eager"
    )
    ours = _DeprecationsOfOurs()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = ours.showwarning  # restored by catch_warnings
        model = zpp_compile.shard(build("gpt"), config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = batch("gpt", 4, 0)
        rank, world = dist.get_rank(), dist.get_world_size()
        runs = (model,) if only_eager else (model, torch.compile(model, backend="zeropp"))
        for run in runs:
            loss_of("gpt", run, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            zpp_compile.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if only_eager:
            return ours.found
        zpp_compile.save_checkpoint(folder, model, opt, checksums=True)
        zpp_compile.load_checkpoint(folder, model, opt)
        zpp_compile.full_state_dict(model)
    return ours.found


def test_zpp_compiles_own_calls_raise_no_deprecation_warnings(pools, tmp_path):
    for rank, found in enumerate(pools(2).run(one_step_of_everything, str(tmp_path / "ckpt"))):
        assert found == [], f"rank {rank}: {found}"
    # The detector sees a deprecated call of ours, although torch locates that warning in its
    # own c10d_logger.py.
    for found in pools(2).run(one_step_of_everything, str(tmp_path / "ckpt2"), True):
        assert found and all("schedule_check.py" in f and "all_gather_into_tensor" in f for f in found), found
