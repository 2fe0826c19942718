"""`create_app(config)`: the aiohttp application around one proxy (proxy.py) and its routes."""

from __future__ import annotations

from aiohttp import web

from epd_proxy.config import Config
from epd_proxy.http.agents import add_agent_routes
from epd_proxy.http.routes import add_routes, middlewares
from epd_proxy.http.status import add_status_routes
from epd_proxy.proxy import STATE, ProxyState


def create_app(config: Config) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares(config))
    state = ProxyState(config)
    app[STATE] = state

    async def lifespan(app: web.Application):
        await state.start()
        yield
        await state.close()

    app.cleanup_ctx.append(lifespan)
    add_routes(app, config)
    add_agent_routes(app)
    add_status_routes(app, state)
    return app
