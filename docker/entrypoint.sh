#!/usr/bin/env bash
# Container entrypoint: bring the database schema to the latest revision, then run the command
# (the image's CMD: `tuner serve --no-worker ...` or `tuner worker`).
# A few attempts, because the database may still be starting (outside compose's depends_on), and
# because two containers upgrading an empty database at once collide: the loser's second
# attempt finds the schema at head and does nothing.
set -euo pipefail

attempts=5
for attempt in $(seq 1 "$attempts"); do
  if tuner db upgrade; then
    break
  fi
  if [ "$attempt" -eq "$attempts" ]; then
    echo "entrypoint: tuner db upgrade failed $attempts times; giving up" >&2
    exit 1
  fi
  echo "entrypoint: tuner db upgrade failed (attempt $attempt of $attempts); retrying in 3 s" >&2
  sleep 3
done

exec "$@"
