"""One router per endpoint family of Tinker's HTTP protocol, all under /api/v1."""

from producer.api.routes import futures, rest, sampling, service, sessions, training

ROUTERS = [service.public, service.router, sessions.router, training.router, training.proto_router, sampling.router,
           futures.router, rest.router]
