"""`loraplex kernels build`: build the native CPU LoRA kernel for this machine, once, ahead of serving.

Engines only load a kernel that is already built (they never wait on a compiler); without one they use
the torch kernels. Run this on each serving node (or image) after installing; `loraplex up` runs it too.
"""

import typer

from app.cli.common import fail

kernels_app = typer.Typer(help="The native CPU multi-LoRA kernel.", no_args_is_help=True)


@kernels_app.command("build")
def build() -> None:
    """Build it unless it is built; prints where it is."""
    from deployments.engine.interface import build_native_kernel  # torch: only for this command

    library = build_native_kernel()
    if library is None:
        fail(
            "the native kernel could not be built here (see the log line above); engines use torch's", code=1
        )
    typer.echo(f"native CPU LoRA kernel: {library}")
