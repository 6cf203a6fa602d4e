#!/bin/sh
# Entrypoint of the sustain container image (deploy/container/Dockerfile).
#
#   docker run IMAGE                      -> sustain run
#   docker run IMAGE --log-level debug    -> sustain run --log-level debug (flags go to `run`)
#   docker run IMAGE config show          -> sustain config show (any sustain command)
#   docker run IMAGE python -m workloads list -> that command, as given
#
# The container image reference baked in at build time (SUSTAIN_IMAGE, from the build argument of
# the same name) is recorded in the stack snapshots as SUSTAIN_CONTAINER_IMAGE, unless that is set
# at run time already.
set -eu

if [ -z "${SUSTAIN_CONTAINER_IMAGE:-}" ]; then
    if [ -n "${SUSTAIN_IMAGE:-}" ]; then
        SUSTAIN_CONTAINER_IMAGE=${SUSTAIN_IMAGE}
        export SUSTAIN_CONTAINER_IMAGE
    else
        # Set but empty would be recorded as an empty image name.
        unset SUSTAIN_CONTAINER_IMAGE
    fi
fi

if [ "$#" -eq 0 ]; then
    exec sustain run
fi

case ${1} in
    "")
        shift
        exec sustain run "$@"
        ;;
    -*)
        exec sustain run "$@"
        ;;
    # The commands of `sustain --help` (agent/cli/main.py); tests/test_deploy.py keeps the two in step.
    run | config | db | probe | analyze | stack | drift | capacity | health | report | runs)
        exec sustain "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
