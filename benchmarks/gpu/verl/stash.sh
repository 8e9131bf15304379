#!/usr/bin/env bash
# On the GPU machine: keep part K of the verl wheels outside the checkout; once every part is
# there, check them and install them into /root/verlsite.
#   usage: bash .verl_run/stash.sh K [COMMAND ...]   (COMMAND runs afterwards, if given)
set -o pipefail
K=$1; shift
mkdir -p /root/verlpayload && cp ".verl$K"/* /root/verlpayload/ || exit 3
if [ ! -f /root/verlsite/.complete ] && (cd /root/verlpayload && sha256sum -c --quiet "$OLDPWD/.verl_run/parts.sha256" >/dev/null 2>&1); then
  rm -rf /root/verlwheels /root/verlsite && mkdir -p /root/verlwheels
  cat /root/verlpayload/wheels.tar.part* | tar -x -C /root/verlwheels || exit 4
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/verlsite \
    /root/verlwheels/wheels/*.whl || exit 5
  touch /root/verlsite/.complete && echo "verl wheels installed in /root/verlsite"
fi
ls /root/verlpayload
[ $# -eq 0 ] || "$@"
