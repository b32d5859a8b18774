"""Disaggregated prefill/decode on the command line: serve's --kv-role / --kv-peer and the
`proxy` command (engine/entrypoints/disagg_proxy.py). Kept apart from the proxy so that the
command line loads no HTTP stack until a command needs it; engine/entrypoints/cli.py adds these."""

from __future__ import annotations


def add_kv_transfer_args(p) -> None:
    """serve's flags for disaggregated prefill/decode across processes (P2pGlooConnector)."""
    p.add_argument(
        "--kv-role",
        choices=("kv_producer", "kv_consumer"),
        default=None,
        help="serve as the prefill (kv_producer) or decode (kv_consumer) half of a "
        "disaggregated pair; the K/V cross over torch.distributed (see docs/kv_connector.md)",
    )
    p.add_argument(
        "--kv-peer",
        metavar="HOST:PORT",
        default=None,
        help="the pair's rendezvous: the producer listens there, the consumer connects to it",
    )


def kv_transfer_config(args):
    """The KVTransferConfig serve's --kv-role / --kv-peer name, or None (ValueError if only one
    of them is given or the address is not HOST:PORT)."""
    from engine.kv_connector import KVTransferConfig
    from engine.worker.kv_p2p import parse_peer

    role, peer = getattr(args, "kv_role", None), getattr(args, "kv_peer", None)
    if role is None and peer is None:
        return None
    if role is None or peer is None:
        raise ValueError("--kv-role and --kv-peer go together (the pair's role and rendezvous)")
    parse_peer(peer)
    return KVTransferConfig("P2pGlooConnector", role, kv_connector_extra_config={"kv_peer": peer})


def cmd_proxy(args) -> int:
    print(
        f"proxying http://{args.host}:{args.port}/v1 → prefill {args.prefill} → decode "
        f"{args.decode}",
        flush=True,
    )
    from engine.entrypoints.disagg_proxy import serve_proxy

    return serve_proxy(args.prefill, args.decode, args.host, args.port, args.log_level)


def add_proxy_parser(sub) -> None:
    """`python -m engine proxy`: one OpenAI endpoint over a prefill and a decode server."""
    p = sub.add_parser(
        "proxy",
        help="disaggregated serving: send each request to a prefill server, then a decode server",
        description="Sends each completion / chat request to the prefill server (serve "
        "--kv-role kv_producer) with max_tokens=1, then to the decode server (serve --kv-role "
        "kv_consumer) with the kv_transfer_params the first answered, and streams the decode "
        "server's answer back.",
    )
    p.add_argument("--prefill", required=True, metavar="URL", help="e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_proxy)
