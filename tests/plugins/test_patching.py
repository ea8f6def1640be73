"""The declarative patch engine (``mcore.adaptors.patching``), against a throwaway module inside mcore."""

from __future__ import annotations

import sys
import types

import pytest
from mcore.adaptors.patching import Kind, Patch, PatchError, active_patch_sets, apply_patches

import mcore

TARGET = "mcore._patching_test_target"


class Base:
    def greet(self):
        return "base"


def _make_module() -> types.ModuleType:
    module = types.ModuleType(TARGET)

    def add(a, b):
        return a + b

    def scale(x):
        return 2 * x

    class Widget(Base):
        def size(self):
            return 1

        @staticmethod
        def kind():
            return "widget"

        @classmethod
        def make(cls):
            return cls.__name__

    add.__module__ = scale.__module__ = Widget.__module__ = TARGET
    module.add, module.scale, module.Widget, module.LIMIT = add, scale, Widget, 10
    return module


@pytest.fixture
def target():
    module = _make_module()
    sys.modules[TARGET] = module
    mcore._patching_test_target = module
    yield module
    for patch_set in active_patch_sets():
        if any(row.target.startswith(TARGET) for row in patch_set.table):
            patch_set.revert()
    del sys.modules[TARGET]
    del mcore._patching_test_target


def add_ten(a, b):
    return a + b + 10


def times_three(fn):
    def wrapper(*args):
        return 3 * fn(*args)

    return wrapper


def plus_one(fn):
    def wrapper(*args):
        return fn(*args) + 1

    return wrapper


def test_replace_wrap_and_revert(target):
    original_add, original_scale = target.add, target.scale
    table = (
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="test"),
        Patch(f"{TARGET}.scale", times_three, Kind.WRAP, reason="test"),
        Patch(f"{TARGET}.LIMIT", 99, Kind.REPLACE, reason="constants can be replaced too"),
    )
    patches = apply_patches(table, name="throwaway")
    assert target.add(1, 2) == 13
    assert target.scale(5) == 30
    assert target.LIMIT == 99
    assert patches.applied == table and patches.active
    patches.revert()
    assert target.add is original_add and target.scale is original_scale and target.LIMIT == 10
    assert not patches.active
    patches.revert()  # reverting twice is a no-op


def test_wrap_rows_stack_in_row_order_and_replacements_may_be_dotted(target):
    target.plus_one = plus_one  # a replacement named by its dotted path
    table = (
        Patch(f"{TARGET}.scale", times_three, Kind.WRAP, reason="r1"),
        Patch(f"{TARGET}.scale", f"{TARGET}.plus_one", Kind.WRAP, reason="r2"),
    )
    apply_patches(table)
    assert target.scale(5) == 31  # the first WRAP row is innermost: plus_one(times_three(scale))


def test_replace_is_the_base_of_wraps_whatever_the_row_order(target):
    table = (
        Patch(f"{TARGET}.add", plus_one, Kind.WRAP, reason="wrap listed first"),
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="replace listed second"),
    )
    apply_patches(table)
    assert target.add(1, 2) == 14  # plus_one(add_ten)


def test_missing_target_fails_naming_the_row_and_changes_nothing(target):
    original = target.add
    table = (
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="fine"),
        Patch(f"{TARGET}.moved_away", add_ten, Kind.REPLACE, reason="this target moved"),
    )
    with pytest.raises(PatchError, match=r"row 1 .*moved_away.*does not resolve"):
        apply_patches(table, name="throwaway")
    assert target.add is original  # resolve-then-mutate: row 0 was not applied


def test_missing_module_and_missing_replacement_fail(target):
    with pytest.raises(PatchError, match=r"row 0 .*mcore.no_such_module"):
        apply_patches((Patch("mcore.no_such_module.fn", add_ten, Kind.REPLACE, reason="x"),))
    with pytest.raises(PatchError, match=r"replacement mcore.ops.reference.nope does not resolve"):
        apply_patches((Patch(f"{TARGET}.add", "mcore.ops.reference.nope", Kind.REPLACE, reason="x"),))


def test_rows_skipped_by_their_condition_are_still_checked(target):
    table = (
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="off", when=lambda: False),
        Patch(f"{TARGET}.scale", times_three, Kind.WRAP, reason="on", when=lambda: True),
    )
    patches = apply_patches(table)
    assert target.add(1, 2) == 3 and target.scale(1) == 6
    assert patches.skipped == (table[0],) and patches.applied == (table[1],)
    assert "skipped: condition false" in patches.describe()
    with pytest.raises(PatchError, match="gone"):
        apply_patches((Patch(f"{TARGET}.gone", add_ten, Kind.REPLACE, reason="off", when=lambda: False),))


def test_one_replace_per_target(target):
    table = (
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="a"),
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="b"),
    )
    with pytest.raises(PatchError, match=r"rows 0 and 1 both REPLACE"):
        apply_patches(table)
    first = apply_patches((Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="a"),), name="first")
    with pytest.raises(PatchError, match="already replaced by the active patch set 'first'"):
        apply_patches((Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="b"),), name="second")
    first.revert()


def test_apply_is_idempotent(target):
    table = (Patch(f"{TARGET}.scale", times_three, Kind.WRAP, reason="once"),)
    first = apply_patches(table)
    second = apply_patches(table)
    assert first is second
    assert target.scale(1) == 6  # wrapped once, not twice


def exclaim(fn):
    def wrapper(cls):
        return fn(cls) + "!"

    return wrapper


def test_class_attributes_keep_their_kind_and_inherited_ones_are_restored(target):
    widget = target.Widget
    table = (
        Patch(f"{TARGET}.Widget.size", plus_one, Kind.WRAP, reason="method"),
        Patch(f"{TARGET}.Widget.kind", lambda: "patched", Kind.REPLACE, reason="staticmethod"),
        Patch(f"{TARGET}.Widget.make", exclaim, Kind.WRAP, reason="classmethod"),
        Patch(f"{TARGET}.Widget.greet", lambda self: "patched", Kind.REPLACE, reason="inherited from Base"),
    )
    patches = apply_patches(table)
    assert widget().size() == 2
    assert widget.kind() == "patched" and isinstance(widget.__dict__["kind"], staticmethod)
    assert widget.make() == "Widget!" and isinstance(widget.__dict__["make"], classmethod)
    assert widget().greet() == "patched"
    patches.revert()
    assert widget().size() == 1 and widget.kind() == "widget" and widget.make() == "Widget"
    assert "greet" not in widget.__dict__ and widget().greet() == "base"


def test_targets_must_be_inside_mcore(target):
    with pytest.raises(PatchError, match="inside mcore"):
        Patch("torch.nn.functional.gelu", add_ten, Kind.REPLACE, reason="no")
    # A path that starts in mcore but walks into another package is refused too.
    with pytest.raises(PatchError, match="not in an mcore module"):
        apply_patches((Patch("mcore.ops.reference.norms.torch.matmul", add_ten, Kind.REPLACE, reason="no"),))


def test_kind_is_declared_and_rows_need_reasons():
    with pytest.raises(PatchError, match="kind must be"):
        Patch(f"{TARGET}.add", add_ten, "replace", reason="x")
    with pytest.raises(PatchError, match="reason"):
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason=" ")


def test_wrap_needs_a_callable_target(target):
    with pytest.raises(PatchError, match="WRAP needs a callable target"):
        apply_patches((Patch(f"{TARGET}.LIMIT", plus_one, Kind.WRAP, reason="x"),))


def test_a_failing_wrapper_factory_rolls_back(target):
    original = target.add

    def broken(fn):
        raise RuntimeError("factory bug")

    table = (
        Patch(f"{TARGET}.add", add_ten, Kind.REPLACE, reason="applied first"),
        Patch(f"{TARGET}.scale", broken, Kind.WRAP, reason="then fails"),
    )
    with pytest.raises(PatchError, match="factory bug.*nothing is patched"):
        apply_patches(table)
    assert target.add is original


def test_revert_refuses_to_clobber_a_later_patch(target):
    first = apply_patches((Patch(f"{TARGET}.scale", times_three, Kind.WRAP, reason="first"),), name="first")
    second = apply_patches((Patch(f"{TARGET}.scale", plus_one, Kind.WRAP, reason="second"),), name="second")
    assert target.scale(1) == 7
    with pytest.raises(PatchError, match="reverse order"):
        first.revert()
    second.revert()
    first.revert()
    assert target.scale(1) == 2
