"""`loraplex up` and `loraplex status`: run the platform on its embedded defaults, and ask Serve how it is.

`up` migrates the database, builds the demo model and adapters when missing, mints a demo tenant key
(printed once), then runs `serve run <config>` until it is stopped (SIGTERM and Ctrl-C both stop it
cleanly, as Ctrl-C would stop `serve run` itself). Ray 2.60 turns token auth on for new local
clusters; we say so explicitly (RAY_AUTH_MODE=token) so that `serve status` finds the token too.
"""

import contextlib
import ctypes
import ctypes.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError

from app.cli.common import fail
from app.private_files import publish_secret
from app.settings import Settings

PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when its parent dies
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
STOP_GRACE_S = 30.0  # `serve run` stops its app and local cluster in seconds; past this it is stuck


def _admin_key(settings: Settings) -> tuple[str, bool]:
    """The configured admin key, or one generated once and kept in data_dir (0600). (key, generated now)"""
    configured = settings.admin_key.get_secret_value()
    if configured:
        return configured, False
    path = settings.data_dir / "admin_key"
    if path.exists():
        return path.read_text().strip(), False
    key = f"lp-admin-{secrets.token_urlsafe(24)}"
    if not publish_secret(path, key):  # another `up` wrote one meanwhile: use that
        return path.read_text().strip(), False
    return key, True


def _effective_config(settings: Settings, config: Path, port: int | None) -> Path:
    if port is None:
        return config
    data = yaml.safe_load(config.read_text())
    data.setdefault("http_options", {})["port"] = port
    out = settings.data_dir / "serve_config.effective.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def up(
    config: Annotated[Path, typer.Option("--config", help="Ray Serve config to run.")] = Path(
        "serve_config.yaml"
    ),
    port: Annotated[int | None, typer.Option("--port", help="HTTP port (overrides the config's).")] = None,
    prepare_only: Annotated[
        bool, typer.Option("--prepare-only", help="Set up, print the key, don't serve.")
    ] = False,
) -> None:
    """Set up the embedded defaults and run the platform (`serve run serve_config.yaml`)."""
    from app.demo import prepare  # heavy imports (torch, transformers) only for this command

    if not config.exists():
        fail(f"{config} not found", code=2, hint="run from the repository root or pass --config")
    try:
        settings = Settings()
    except ValidationError as exc:  # e.g. a LORAPLEX_ADMIN_KEY under 32 bytes: refused before anything runs
        fail(f"invalid LORAPLEX_* setting: {exc}", code=2)
    typer.echo("preparing: database migrations, demo model and adapters (first run builds them)...")
    try:
        demo = prepare(settings, config)
    except FileNotFoundError as error:
        fail(str(error), code=2)
    typer.echo("preparing: the native CPU LoRA kernel (built once per machine)...")
    from deployments.engine.interface import build_native_kernel

    if build_native_kernel() is None:
        typer.echo("  not built here: the engines use the torch kernels (slower, same results)")
    admin_key, generated = _admin_key(settings)
    http = yaml.safe_load(config.read_text()).get("http_options", {})
    url = f"http://{http.get('host', '127.0.0.1')}:{port or http.get('port', 8000)}"
    typer.echo(f"models: {', '.join(demo.models)}; demo adapters: {', '.join(demo.adapters) or 'none'}")
    typer.echo(f"demo tenant {demo.tenant_id} key (shown once, store it now):")
    print(f"LORAPLEX_DEMO_KEY={demo.api_key}", flush=True)
    if generated:
        typer.echo(f"admin key generated and saved in {settings.data_dir / 'admin_key'}")
    typer.echo(
        f'try: curl {url}/v1/chat/completions -H "authorization: Bearer $LORAPLEX_DEMO_KEY" '
        f'-H \'content-type: application/json\' -d \'{{"model": "{next(iter(demo.models))}", '
        '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}\''
    )
    if prepare_only:
        return
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve is None:
        fail("the Ray Serve CLI (`serve`) is not installed", code=2)
    env = {
        **os.environ,
        "LORAPLEX_ADMIN_KEY": admin_key,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
    }
    effective = _effective_config(settings, config, port)
    typer.echo(f"starting: serve run {effective} (Ctrl-C or SIGTERM stops it)")
    sys.stdout.flush()
    raise typer.Exit(_serve_until_stopped([serve, "run", str(effective)], env))


def _child_signals() -> None:
    """In the child, before `serve run` starts: signal dispositions and mask as a fresh process has them,
    whatever `up` inherited; and SIGINT when `up` is killed outright (SIGKILL), so it still shuts down.

    Ignored signals and the blocked mask survive exec: started as a script's background job (`up &`,
    where the shell ignores SIGINT), `serve run` ignored the SIGINT `up` forwards and never stopped."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    except (OSError, AttributeError):  # not Linux: nothing to arm
        pass


def _serve_until_stopped(command: list[str], env: dict[str, str], grace_s: float = STOP_GRACE_S) -> int:
    """Run `serve run` as a child and turn the first SIGTERM (or SIGHUP or SIGINT, unless `up` was started
    ignoring them, as nohup and background jobs are) into its SIGINT; if it has not stopped `grace_s`
    later, or on a second such signal, SIGKILL its process group (it and the local cluster it started).

    `serve run` shuts the application and its local cluster down cleanly on SIGINT (KeyboardInterrupt),
    while SIGTERM makes Ray's native failure handler print a stack trace as it dies. Returns 0 when it
    stopped because we asked it to, else its own exit status."""
    child = subprocess.Popen(command, env=env, process_group=0, preexec_fn=_child_signals)
    asked: list[float] = []  # when each stop signal came

    def forward(signum: int, _: object) -> None:
        asked.append(time.monotonic())
        if len(asked) == 1:
            child.send_signal(signal.SIGINT)

    for signum in _STOP_SIGNALS:
        if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, forward)
    while True:
        try:
            code = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:  # so it is not reaped yet: its pid still names its group
            if len(asked) > 1 or (asked and time.monotonic() - asked[0] > grace_s):
                typer.echo("serve run did not stop on SIGINT: killing it and its local cluster", err=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)  # Ray's processes stay in its group
    return 0 if asked else code


def status() -> None:
    """`serve status` for the local cluster (with the token auth that `up` enabled)."""
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve is None:
        fail("the Ray Serve CLI (`serve`) is not installed", code=2)
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    os.execve(serve, [serve, "status"], env)
