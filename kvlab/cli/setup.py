"""`kvlab prepare` (models and the Jupyter kernel) and `kvlab demo`."""

from __future__ import annotations


def register(sub) -> None:
    s = sub.add_parser("prepare", help="convert the embedded model, build the tiny ones, install the kernel")
    s.set_defaults(func=prepare)

    s = sub.add_parser("demo", help="a short report on the embedded model")
    s.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, tiny:<model_type> (any cache family), or a folder")
    s.set_defaults(func=demo)


def prepare(args) -> int:
    from ..device import KVLAB_ATTENTION, current
    from ..experiments.kernel import install_kernelspec
    from ..models import cpu_attention
    from ..models.loading import prepare as prepare_models

    prepare_models()
    if current().attention == KVLAB_ATTENTION:
        print(f"kvlab: CPU attention kernel compiled in {cpu_attention.warm():.1f}s")
    install_kernelspec()
    return 0


def demo(args) -> int:
    from ..experiments.demo import main as run_demo

    return run_demo(args.model)
