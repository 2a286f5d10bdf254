"""A Debian trixie chroot with real torch 2.6 (Debian's python3-torch), for the tests that need a
torch able to write Distributed Checkpoints; the machine's own torch is Debian 12's 1.13.

ensure() builds it once per machine into $RESHARD_TORCH2_ROOT (default
/var/cache/reshard/trixie-torch2), about 1.6 GB and a few minutes; run() runs a python3 script in it.
Both do their mounts inside a private mount namespace (`unshare -m`), so the mounts end with the
process that made them: a failed or killed run leaves nothing mounted on the host.
"""
import fcntl
import glob
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse

ROOT = os.environ.get('RESHARD_TORCH2_ROOT', '/var/cache/reshard/trixie-torch2')
PACKAGES = ['python3-torch', 'python3-numpy']


def _mirror():
    """The Debian archive to build from: $RESHARD_DEBIAN_MIRROR, else the first archive this
    machine's own apt sources name (deb822 `URIs:` or one-line `deb URI ...`), else None."""
    if os.environ.get('RESHARD_DEBIAN_MIRROR'):
        return os.environ['RESHARD_DEBIAN_MIRROR']
    for path in ['/etc/apt/sources.list'] + sorted(glob.glob('/etc/apt/sources.list.d/*.sources')) + \
            sorted(glob.glob('/etc/apt/sources.list.d/*.list')):
        try:
            with open(path) as f:
                for line in f:
                    words = line.split()
                    if words[:1] == ['URIs:'] and len(words) > 1:
                        return words[1]
                    if words[:1] == ['deb'] and len(words) > 1:
                        return next((w for w in words[1:] if '://' in w), None)
        except OSError:
            continue
    return None


def root_or_skip():
    """The finished chroot's path; else the test (or its class, from setUpClass) is skipped with
    one line saying why."""
    import unittest
    root, why = ensure()
    if root is None:
        print('skipped:', why, file=sys.stderr)
        raise unittest.SkipTest(why)
    return root


def ensure():
    """(path of the finished chroot, None), or (None, one line saying why it cannot be had)."""
    if os.path.exists(os.path.join(ROOT, 'usr', 'bin', 'python3')):
        return ROOT, None
    if os.geteuid() != 0:
        return None, f'the torch 2 chroot {ROOT} is not built, and building it needs root'
    if not shutil.which('debootstrap'):
        _quiet(['apt-get', 'update'])
        _quiet(['apt-get', 'install', '-y', 'debootstrap'])
        if not shutil.which('debootstrap'):
            return None, 'debootstrap is missing and `apt-get install debootstrap` did not install it'
    mirror = _mirror()
    if mirror is None:
        return None, 'no Debian archive to build the torch 2 chroot from: set RESHARD_DEBIAN_MIRROR'
    url = urllib.parse.urlsplit(mirror)
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=10).close()
    except OSError as e:
        return None, f'cannot reach the Debian archive {mirror} to build the torch 2 chroot ({e})'
    os.makedirs(os.path.dirname(ROOT), exist_ok=True)
    # One builder at a time; a second waits, then finds the chroot finished.
    with open(ROOT + '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(ROOT):
            why = _build(mirror)
            if why:
                return None, why
    return ROOT, None


def _build(mirror):
    """Builds into ROOT.partial and renames it to ROOT only when complete, so a killed build is never
    taken for a finished one. Returns None, or why it failed."""
    partial, log = ROOT + '.partial', ROOT + '.log'
    shutil.rmtree(partial, ignore_errors=True)  # a killed build's leftovers
    install = ('apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends '
               + ' '.join(PACKAGES) + ' && apt-get clean')
    steps = [('debootstrap', ['unshare', '-m', '--propagation', 'private',
                              'debootstrap', '--variant=minbase', 'trixie', partial, mirror]),
             ('apt-get install', _chroot_command(partial, ['sh', '-c', install], {}))]
    with open(log, 'w') as out:
        for name, step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                return f'building the torch 2 chroot {ROOT} failed at {name}: see {log}'
    os.rename(partial, ROOT)
    return None


def _chroot_command(root, argv, binds):
    """A command that mounts /proc, a fresh /dev/shm (multiprocessing's semaphores) and the
    {host folder: folder inside} binds in a private mount namespace, then runs argv in the chroot."""
    mounts = [('-t proc proc', '/proc'), ('-t tmpfs tmpfs', '/dev/shm')]
    mounts += [('--bind ' + shlex.quote(host), inside) for host, inside in binds.items()]
    script = ' && '.join(f'mkdir -p {shlex.quote(root + inside)} && mount {how} {shlex.quote(root + inside)}'
                         for how, inside in mounts)
    script += ' && exec chroot ' + shlex.quote(root) + ' ' + ' '.join(map(shlex.quote, argv))
    return ['unshare', '-m', '--propagation', 'private', 'sh', '-c', script]


# The end of a forked rank's function in a script run() runs: once every rank has reached it,
# the process exits at once. torch 2.6's destroy_process_group (gloo, this host) was seen to hang
# for good now and then in the last rank to reach it, the others gone.
END_RANK = r"""
def end_rank(dist):
    import os
    dist.barrier()
    os._exit(0)
"""


def run(root, script, binds, timeout=300, attempts=2):
    """Runs python3 -c script in the chroot with the binds mounted; returns the CompletedProcess
    (text output). The mounts go with the namespace when the run ends, however it ends. A run that
    outlives `timeout` seconds (these scripts take seconds) is killed with every process it started
    (forked ranks too) and run again, up to `attempts` runs in all, each retry said in one line:
    torch 2.6's distributed runs on this host hang now and then where a second run does not
    (END_RANK avoids the hang seen most), and a hang is not what these tests check. The last
    timeout raises TimeoutExpired."""
    # GLOO_SOCKET_IFNAME: gloo otherwise finds its address by resolving the host's name, which the chroot's
    # /etc/hosts lacks: every process group (Megatron-Core makes dozens) asked DNS, and now and then waited 5 s
    # for the resolver to give up. The ranks all run on this host, over loopback.
    env = {'PATH': '/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin', 'HOME': '/root', 'LANG': 'C.UTF-8',
           'USE_LIBUV': '0', 'PYTHONDONTWRITEBYTECODE': '1', 'GLOO_SOCKET_IFNAME': 'lo'}
    argv = _chroot_command(root, ['/usr/bin/python3', '-c', script], binds)
    for attempt in range(1, attempts + 1):
        with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, start_new_session=True) as p:
            try:
                out, err = p.communicate(timeout=timeout)
                return subprocess.CompletedProcess(argv, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
                if attempt == attempts:
                    raise
                print(f'torch 2.6 run hung for {timeout} s and was killed; running it again '
                      f'(attempt {attempt + 1} of {attempts})', file=sys.stderr)


def _quiet(argv):
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
