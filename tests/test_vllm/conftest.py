"""The vLLM line's order: the family sweep runs last. Building vLLM's classes for every family imports modules (its
Inkling processor: numba, so llvmlite) whose objects break the kernel dispatcher's scan of ``sys.modules`` that
``vllm.LLM`` runs on start (llvmlite's ``_lib_fn_wrapper`` has a ``__dict__`` without ``get``), so an engine started
after it in the same process fails; the loaders alone do not start one."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: item.path.name == "test_vllm_families.py")  # stable: every other test keeps its order
