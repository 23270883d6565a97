"""Which engine serves the app: the model in a process of its own, in this process, or an external
OpenAI-compatible server. `main` makes the one it needs and hands it on."""

from app.config import AppConfig
from app.zerogpu import on_zero_gpu, zero_gpu_enabled


def make_manager(config: AppConfig):
    """The engine for `config`, not yet loaded (ModelManager, EngineProcess or OpenAIEngine: one interface)."""
    if config.backend == "openai":
        from app.engine.openai_backend import OpenAIEngine

        return OpenAIEngine(config)
    if config.engine_process and not zero_gpu_enabled():  # on ZeroGPU the GPU exists only in this process
        from app.engine.client import EngineProcess

        return EngineProcess(config)
    from app.engine.core import ModelManager

    return ModelManager(config)


def load_manager(config: AppConfig):
    """The engine for `config`, loaded and warmed up."""
    manager = make_manager(config)
    load_and_warm_up(manager, config)
    return manager


def load_and_warm_up(manager, config: AppConfig) -> None:
    manager.load()
    if config.warmup:
        on_zero_gpu(manager.warm_up)()
        manager.metrics.reset()  # the panel and /metrics count users' requests, not the warm-up's
