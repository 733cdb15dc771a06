#!/usr/bin/env bash
# Install what the test Slurm cluster needs: Debian's slurm-wlm + munge, and iproute2/util-linux
# for the bridge and per-node network namespaces. Idempotent and fast when already installed:
# apt is only touched when a binary is missing. Non-interactive (no debconf prompts).
#
# The README's test command starts with this script, so it never stops that command where it
# cannot install: not root, or not Debian/apt, it only prints why and exits 0 (the Slurm tests
# then skip, naming what is missing). As root on Debian a failed apt-get is an error (exit 1).
set -euo pipefail

skip() {
    echo "tests/cluster/install.sh: not installing ${need[*]}: $1; the Slurm tests will skip (chromium: the batch report's browser test)" >&2
    exit 0
}

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v slurmd >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# nsenter and unshare start each slurmd inside its node's namespaces.
{ command -v nsenter && command -v unshare; } >/dev/null 2>&1 || need+=(util-linux)
# hostname sets each node's own UTS name.
command -v hostname >/dev/null 2>&1 || need+=(hostname)
# Not for Slurm: the batch report's browser test (tests/test_report_html.py) opens the page in
# Debian's headless chromium.
command -v chromium >/dev/null 2>&1 || need+=(chromium)

if [ "${#need[@]}" -eq 0 ]; then
    echo "tests/cluster/install.sh: slurm-wlm, munge, iproute2, chromium already installed"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || skip "needs root (run it as root, or: sudo bash tests/cluster/install.sh)"
[ -f /etc/debian_version ] || skip "not a Debian system (install slurm-wlm and munge yourself)"
command -v apt-get >/dev/null 2>&1 || skip "apt-get not found"

export DEBIAN_FRONTEND=noninteractive
# Deduplicate (slurm-wlm can be listed twice).
mapfile -t pkgs < <(printf '%s\n' "${need[@]}" | sort -u)
# apt-get update only when the package lists are missing or the install fails for want of them.
if ! apt-get install -y --no-install-recommends "${pkgs[@]}"; then
    if ! { apt-get update && apt-get install -y --no-install-recommends "${pkgs[@]}"; }; then
        echo "tests/cluster/install.sh: apt-get could not install ${pkgs[*]} (see above); to run" \
            "the tests without the Slurm ones: .venv/bin/python -m pytest" >&2
        exit 1
    fi
fi
# Debian's munge postinst creates /etc/munge/munge.key; make one if it did not (no systemd here).
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
fi
echo "tests/cluster/install.sh: installed ${pkgs[*]}"
