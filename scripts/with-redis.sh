#!/usr/bin/env bash
# Run a command with REDIS_URL pointing at a Redis. If REDIS_URL is already set it is used as is;
# otherwise a private redis-server is started on a free loopback port (Debian's package is
# installed if missing) and stopped by pid when the command ends.
set -euo pipefail

if [[ -n "${REDIS_URL:-}" ]]; then
  exec "$@"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "with-redis: redis-server not found; installing Debian's redis-server" >&2
  SUDO=""; [[ "$(id -u)" == 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d -t tinkerq-redis-XXXXXX)
redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save '' --appendonly no \
  --maxmemory-policy noeviction --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"

stop() {
  if [[ -f "$dir/redis.pid" ]]; then kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap stop EXIT

for _ in $(seq 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
echo "with-redis: private redis-server on 127.0.0.1:$port (pid $(cat "$dir/redis.pid"))" >&2
export REDIS_URL="redis://127.0.0.1:$port/0"
"$@"
