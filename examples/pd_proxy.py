"""A prefill/decode proxy for two ``vllm serve`` instances that share a KV pool.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill instance
(``kv_role: kv_producer``) with ``max_tokens`` 1 and no streaming: when it answers, the
prompt's KV is in the pool (kvflow commits a step's save before vLLM returns the step's
output). The request then goes, unchanged, to a decode instance (``kv_role: kv_consumer``),
which loads that KV instead of computing the prompt, and its answer (streamed or not) is passed
back as it comes. Nothing travels between the instances but the pool's chunks: unlike vLLM's
own P/D proxy, no ``kv_transfer_params`` are needed. Several ``--prefill`` and ``--decode``
instances are used in turn.

    python examples/pd_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Needs aiohttp (vLLM depends on it). A prefill instance that fails is reported to the client
as a 502 with its answer; the decode instance is not asked then.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

PREFILL_KEYS = {"max_tokens": 1, "max_completion_tokens": 1, "stream": False}
TIMEOUT = ClientTimeout(total=None, sock_connect=10, sock_read=600)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", *PREFILL_KEYS)}
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self._prefill: Iterator[str] = itertools.cycle(prefill)
        self._decode: Iterator[str] = itertools.cycle(decode)
        self._first_decode = decode[0]
        self._session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=TIMEOUT)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "the proxy is not started"
        return self._session

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prefill = next(self._prefill)
        async with self.session.post(
            prefill + request.path, json=prefill_body(body, chat)
        ) as answer:
            if answer.status != 200:
                text = await answer.text()
                return web.json_response(
                    {"error": f"prefill instance {prefill} answered {answer.status}: {text}"},
                    status=502,
                )
            await answer.read()
        decode = next(self._decode)
        async with self.session.post(decode + request.path, json=body) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for piece in answer.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response

    async def forward_get(self, request: web.Request) -> web.Response:
        async with self.session.get(self._first_decode + request.path) as answer:
            return web.Response(
                status=answer.status, body=await answer.read(), content_type=answer.content_type
            )


def app(prefill: list[str], decode: list[str]) -> web.Application:
    proxy = Proxy(prefill, decode)
    application = web.Application(client_max_size=64 << 20)
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.stop)
    application.router.add_post("/v1/completions", proxy.generate)
    application.router.add_post("/v1/chat/completions", proxy.generate)
    application.router.add_get("/v1/models", proxy.forward_get)
    application.router.add_get("/health", proxy.forward_get)
    return application


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="a prefill URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode URL")
    args = parser.parse_args(argv)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}", **vars(args)}), flush=True)
    web.run_app(app(args.prefill, args.decode), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
