"""`kvyard deploy`: run a fleet (replicas by role, routers, a shared KV tier) on a Ray cluster."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from typing import Any

from kvyard.cli import fail

DESCRIPTION = (
    "Run a fleet on Ray from a spec: replicas by role (unified, prefill, decode), routers kept "
    "current as replicas come, die and go, and a shared KV tier. Also --status, --scale and --down."
)
EPILOG = """examples:
  kvyard deploy fleet.yaml                       start it (a local Ray cluster if none runs)
  kvyard deploy fleet.yaml --address HEAD:6379   on a multi-node Ray cluster
  kvyard deploy fleet.yaml --status              what runs where
  kvyard deploy fleet.yaml --scale unified=4     more replicas; fewer are drained first
  kvyard deploy fleet.yaml --down                stop everything"""
CONTROLLER = "controller"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "deploy",
        help="run a fleet of replicas and routers on Ray",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", nargs="?", metavar="FLEET.yaml", help="the fleet spec (see docs/deploy.md)")
    parser.add_argument("--name", help="the fleet's name, instead of reading it from FLEET.yaml")
    parser.add_argument(
        "--address",
        help="the Ray cluster (host:port); default $RAY_ADDRESS, else the one running "
        "on this machine, else (deploy only) a new single-node one",
    )
    actions = parser.add_mutually_exclusive_group()
    actions.add_argument("--status", action="store_true", help="show the fleet's processes and routers' views")
    actions.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="ROLE=N",
        help="set the number of replicas of a role (unified, prefill, decode); repeatable",
    )
    actions.add_argument("--down", action="store_true", help="stop the fleet's routers and replicas")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=900.0,
        help="deploy and --scale: give up waiting after this long, leaving the fleet as it is (default: 900)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvyard.deploy.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec) if args.spec else None
        scales = [_parse_scale(text) for text in args.scale]
    except SpecError as error:
        return fail(str(error))
    name = args.name or (spec.name if spec is not None else None)
    if name is None:
        return fail("give FLEET.yaml, or --name for a fleet already deployed")
    if spec is None and not (args.status or args.scale or args.down):
        return fail("deploying needs FLEET.yaml")
    try:
        import ray
    except ImportError:
        return fail("kvyard deploy needs Ray: bash scripts/setup.sh --fleet (or pip install 'kvyard[fleet]')")
    from kvyard.deploy.ray_cluster import NoCluster, connect

    namespace = f"kvyard-{name}"
    deploying = not (args.status or args.scale or args.down)
    head = spec.ray if deploying and spec is not None else None  # what to start when no cluster runs
    try:
        started_local = connect(args.address, namespace, start_local=head)
    except NoCluster as error:
        return fail(str(error), 1)
    _say(f"connected to Ray ({len(ray.nodes())} node(s)){', started here' if started_local else ''}")
    try:
        controller = ray.get_actor(CONTROLLER, namespace=namespace)
    except ValueError:
        controller = None
    if deploying:
        assert spec is not None
        return _deploy(spec, controller, args.json, args.timeout_s)
    if controller is None:
        return fail(f"no fleet named {name!r} on this Ray cluster", 1)
    if args.status:
        status: Any = ray.get(controller.status.remote())
        return _print_status(status, args.json)
    if args.scale:
        return _scale(controller, scales, args.json, args.timeout_s)
    return _down(controller, namespace)


def _deploy(spec: Any, controller: Any, as_json: bool, timeout_s: float) -> int:
    from kvyard.deploy.controller import ControllerActor, FleetSecrets

    if controller is None:
        keys = FleetSecrets(secrets.token_urlsafe(24), secrets.token_urlsafe(24), secrets.token_urlsafe(24))
        controller = ControllerActor.options(
            name=CONTROLLER,
            namespace=spec.namespace,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=16,
            num_cpus=0,
        ).remote(spec, keys)
        _say(f"fleet {spec.name}: starting {_summary(spec)}")
    else:
        _say(f"fleet {spec.name} is already deployed: starting what it lacks (options change only after --down)")
    return _wait_and_report(controller, controller.apply.remote(), as_json, timeout_s)


def _scale(controller: Any, scales: list[tuple[str, int]], as_json: bool, timeout_s: float) -> int:
    code = 0
    for role, count in scales:
        _say(f"scaling {role} to {count} (replicas that leave are drained first)")
        code = _wait_and_report(controller, controller.scale.remote(role, count), as_json, timeout_s)
        if code:
            break
    return code


def _down(controller: Any, namespace: str) -> int:
    import ray

    from kvyard.deploy.ray_cluster import stop_local_head_if_ours

    _say("stopping routers, then replicas (each finishes what it serves)")
    stopped = ray.get(controller.down.remote())["stopped"]
    ray.kill(controller, no_restart=True)
    _say(f"stopped {len(stopped)} process(es): {', '.join(stopped) or 'none'}")
    others = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == CONTROLLER and a["namespace"] != namespace
    ]
    ray.shutdown()
    if not others and stop_local_head_if_ours():
        _say("stopped the local Ray cluster kvyard deploy had started")
    return 0


def _wait_and_report(controller: Any, call: Any, as_json: bool, timeout_s: float) -> int:
    """Wait for `call` (apply or scale), saying how many processes are up and what Ray cannot place; print the
    status."""
    import ray

    started = time.monotonic()
    last_line, last_change, last_hint = "", started, started - 60
    while not ray.wait([call], timeout=2.0)[0]:
        now = time.monotonic()
        if now - started > timeout_s:
            return fail(
                f"not ready after {timeout_s:g} s; the fleet keeps starting as it is: see --status, or --down", 1
            )
        members = ray.get(controller.status.remote())["members"]
        line = f"{sum(m['reachable'] for m in members)}/{len(members)} processes ready"
        if line != last_line:
            _say(f"{line} ({now - started:.0f} s)")
            last_line, last_change = line, now
        elif now - last_change > 15 and now - last_hint > 60:
            _say(_placement_hint([m for m in members if not m["reachable"] and not m.get("url")]))
            last_hint = now
    try:
        status = ray.get(call)
    except ray.exceptions.RayTaskError as error:
        return fail(str(error.cause if getattr(error, "cause", None) else error), 1)
    return _print_status(status, as_json)


def _placement_hint(waiting: list[dict[str, Any]]) -> str:
    """What the processes that never started ask for, beside what the cluster has free."""
    import ray

    if not waiting:
        return "still waiting for processes to answer (see their logs under /tmp/kvyard-deploy/ on their nodes)"
    asks = "; ".join(f"{m['name']} needs {_resources(m['needs']) or 'nothing'}" for m in waiting)
    free, total = ray.available_resources(), ray.cluster_resources()
    have = ", ".join(
        f"{key} {free.get(key, 0):g} of {total[key]:g}"
        for key in sorted(total)
        if key in ("CPU", "GPU") or key in {k for m in waiting for k in m["needs"]}
    )
    return (
        f"waiting for Ray to place them: {asks}. Free in the cluster: {have}. Lower num_cpus/num_gpus in the "
        "spec, add nodes, or --down"
    )


def _resources(needs: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in needs.items())


def _print_status(status: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(f"fleet {status['name']} (Ray namespace {status['namespace']}), model {status['model']}")
    routed = {
        url: view for router in status["routers"].values() if "error" not in router for url, view in router.items()
    }
    for member in status["members"]:
        state = routed.get(member.get("url"), {}).get("state", "-") if member["role"] != "router" else "-"
        health = (
            "ready"
            if member["reachable"]
            else "failed"
            if member["error"]
            else ("restarting" if member.get("url") else "starting")
        )
        print(
            f"  {member['name']:<22} {health:<10} {member.get('url', '-'):<28} router view: {state:<9} "
            f"node {member.get('node_ip', '-')}"
        )
        if member["error"]:
            print(f"    {member['error'].splitlines()[-1]}")
    routers = [m["url"] for m in status["members"] if m["role"] == "router" and m.get("url")]
    if routers:
        print(f"send requests to: {', '.join(routers)} (OpenAI API: /v1/completions, /v1/chat/completions)")
    return 0


def _parse_scale(text: str) -> tuple[str, int]:
    from kvyard.deploy.spec import ROLES, SpecError

    role, _, count = text.partition("=")
    if role not in ROLES or not count.isdigit():
        raise SpecError(f"--scale takes ROLE=N with ROLE one of {', '.join(ROLES)}, got {text!r}")
    return role, int(count)


def _summary(spec: Any) -> str:
    parts = [f"{role.replicas} {name}" for name, role in spec.roles.items() if role.replicas]
    if spec.external_replicas:
        parts.append(f"{len(spec.external_replicas)} external")
    return f"{', '.join(parts)} replica(s) and {spec.router.replicas} router(s)"


def _say(message: str) -> None:
    print(f"kvyard deploy: {message}", file=sys.stderr, flush=True)
