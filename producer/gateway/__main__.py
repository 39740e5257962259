"""streambatch-gateway --redis-url URL [--redis-cluster] --host H --port P [--anonymous-tenant NAME]

The OpenAI-compatible HTTP gateway under uvicorn. Stateless: run as many replicas as you like
behind a load balancer, all on the same Redis.
"""

from __future__ import annotations

import argparse
import os
import sys

from producer.connect import add_cluster_flag
from producer.gateway.shapes import DEFAULT_MAX_TOKENS
from producer.protocol import PASSWORD_ON_COMMAND_LINE, check_tenant, has_password, read_password, redacted
from producer.shell import DEFAULT_URL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streambatch-gateway", description=__doc__.split("\n")[0])
    # Defaults from the environment are read after parsing, never shown by --help (a URL may hold a password).
    parser.add_argument("--redis-url", help=f"default: $STREAMBATCH_REDIS_URL, else {DEFAULT_URL}")
    parser.add_argument("--redis-password-file", default=os.environ.get("STREAMBATCH_REDIS_PASSWORD_FILE"),
                        help="a file holding the Redis password (default: $STREAMBATCH_REDIS_PASSWORD_FILE)")
    add_cluster_flag(parser)
    parser.add_argument("--prefix", default=os.environ.get("STREAMBATCH_PREFIX", "sb"), help="key prefix")
    parser.add_argument("--host", default=os.environ.get("STREAMBATCH_GATEWAY_HOST", "127.0.0.1"),
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("STREAMBATCH_GATEWAY_PORT", 8000)))
    parser.add_argument("--anonymous-tenant", default=os.environ.get("STREAMBATCH_ANONYMOUS_TENANT"),
                        help="serve requests without an API key as this tenant (the embedded start and the demo "
                             "only); without it every request needs `Authorization: Bearer <key>`")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="max_tokens of a chat or Responses request that gives none")
    parser.add_argument("--queue-timeout", type=float, default=None,
                        help="seconds a request may wait for a worker to start it; past them it ends with a 504 "
                             "(default: it waits)")
    parser.add_argument("--log-level", default="info", help="uvicorn's: debug, info, warning or error")
    args = parser.parse_args(argv)
    if args.redis_url is not None and has_password(args.redis_url):
        print(f"streambatch-gateway: warning: {PASSWORD_ON_COMMAND_LINE}", file=sys.stderr)
    url = args.redis_url or os.environ.get("STREAMBATCH_REDIS_URL") or DEFAULT_URL
    try:
        password = read_password(args.redis_password_file) if args.redis_password_file else None
        if args.anonymous_tenant is not None:
            check_tenant(args.anonymous_tenant)
    except (OSError, ValueError) as error:
        parser.error(str(error))

    import uvicorn

    from producer.gateway.app import Settings, create_app

    app = create_app(Settings(url, password, args.prefix, args.anonymous_tenant, args.default_max_tokens,
                              args.queue_timeout, args.redis_cluster))
    print(f"streambatch-gateway: http://{args.host}:{args.port}/v1 on {redacted(url)}"
          + (f", anonymous requests as tenant {args.anonymous_tenant}" if args.anonymous_tenant else ""), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
