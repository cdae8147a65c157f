"""Assertions shared by several test files (tests share helpers through a module, not each other)."""

MACHINE_FIELDS = ("cpu", "cores", "torch_threads", "memory_gib", "torch", "gpus")


def assert_machine_fields(info: dict) -> None:
    """``info`` is mnist_dist.machine.describe(): every field present and non-empty."""
    for field in MACHINE_FIELDS:
        assert info[field] not in ("", None), field
    assert isinstance(info["cpu_flags"], list)
    if info["gpus"]:
        assert info["gpu"] and info["cuda"] and info["driver"]
