#!/usr/bin/env bash
# An emulated 2-host cluster on one machine: network namespaces joined by a Linux bridge,
# every link shaped with tc tbf, Open MPI launched across the namespaces.
#
#   benchmarks/emulated_cluster.sh [options] [--] COMMAND [ARGS...]      (as root)
#
# Runs `mpirun <cluster flags> COMMAND ARGS...` once per --rate (default: 100mbit), one rank
# per emulated host, and removes everything it created on exit (also on Ctrl-C or error).
# Needs root (ip netns, tc), iproute2 (installed with apt-get when `ip` is missing) and
# util-linux's unshare; mpirun is taken from PATH (activate the venv first).
#
# Topology (all of it inside namespaces this script creates; the machine's own network
# namespace, interfaces and addresses are not touched):
#
#     netns h0: eth0 10.77.0.1/24 --veth-- p0 \
#                                              br0 10.77.0.254/24   (netns hctl: mpirun)
#     netns h1: eth0 10.77.0.2/24 --veth-- p1 /
#
# Both ends of every veth link are shaped with
#     tc qdisc replace dev ... root tbf rate RATE burst 512kb latency 100ms
# so each host sends at most RATE into the bridge and receives at most RATE from it (like a
# switch port of that speed). mpirun runs in the bridge's namespace hctl and starts one
# daemon per host through an rsh agent that runs
#     ip netns exec hN unshare --uts sh -c "hostname hN; <daemon command>"
# Each namespace gets its own host name: Open MPI decides what is node-local by host name,
# and ranks in different namespaces under one name would be taken for neighbours on one
# node (shared memory, node-local collectives) that cannot reach each other that way. MPI traffic is TCP on the bridge subnet:
#     --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24
#     --prtemca oob_tcp_if_include 10.77.0.0/24
#
# Open MPI 5's TCP BTL by default moves large messages with its emulated-RDMA "put"
# protocol; on the shaped links that ran at half the link rate after the first message
# (32 MB Sendrecv: 2.8 s once, then 5.4 s; Python sockets: 2.8 s every time). The script
# therefore passes --mca btl_tcp_flags send (plain send/receive), with which MPI_Allreduce
# of 33.6 MB takes 2.8-3.15 s at 100 Mbit/s against a 2.69 s floor; --no-tcp-tuning drops it.
#
# The ranks see EMU_LINK_RATE (the current rate), EMU_PER_FLOW (1 with --per-flow) and
# EMU_NET_IF (eth0, the host's link, whose /sys/class/net/eth0/statistics/tx_bytes counts
# what the host sent).
#
# Options:
#   --rate RATE     tbf rate (tc syntax: 1gbit, 100mbit, ...); repeat for several runs.
#                   "unshaped" runs without a qdisc (veth at memory speed).
#   --per-flow      RATE limits each TCP connection instead of each link (the cloud-style
#                   per-flow limit under which several connections per peer can help):
#                   every host sends through htb with 512 classes of RATE, a TCP packet's
#                   class picked by u32 hashing of its ephemeral port (the low byte of the
#                   destination port for packets from a listening port, 50000-50015, else
#                   of the source port); the bridge ports are left unshaped. Open MPI's TCP
#                   BTL is told to listen there (btl_tcp_port_min_v4 50000, range 16).
#                   Flows whose ports share a low byte share a class. (sch_fq, whose
#                   "fq maxrate" would pace each flow exactly, is missing from this kernel.)
#   --hosts N       emulated hosts, one rank each (default 2).
#   --subnet A.B.C  /24 prefix of the bridge subnet (default 10.77.0; private range only).
#   --prefix NAME   namespace names are NAME0, NAME1, ... and NAMEctl (default h).
#   --mpirun-arg X  extra argument for mpirun (repeatable), e.g. --mpirun-arg=-x --mpirun-arg=FOO
#   --keep          skip the cleanup (debugging; remove later with --cleanup-only, and the
#                   printed agent directory by hand).
#   --no-tcp-tuning keep Open MPI's default btl_tcp_flags (see above).
#   --cleanup-only  remove namespaces, bridge and files left by an earlier --keep run.
#
# Open MPI prints "plm:ssh: Warning: setpgid(...) failed ... Permission denied" once per run
# here (from the rsh launcher running inside a namespace); the run is unaffected.
#
# Example (the tables of benchmarks/README.md; about 10 minutes):
#   . .venv/bin/activate
#   benchmarks/emulated_cluster.sh --rate 1gbit --rate 300mbit --rate 100mbit -- \
#       python benchmarks/algorithms.py --warmup 2 --steps 3 --repeats 2 \
#       --json-dir benchmarks/results/run_2

set -euo pipefail

RATES=()
HOSTS=2
SUBNET=10.77.0
PREFIX=h
KEEP=0
CLEANUP_ONLY=0
TCP_TUNING=1
PER_FLOW=0
MPIRUN_EXTRA=()

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --rate) RATES+=("$2"); shift 2 ;;
        --rate=*) RATES+=("${1#*=}"); shift ;;
        --hosts) HOSTS="$2"; shift 2 ;;
        --hosts=*) HOSTS="${1#*=}"; shift ;;
        --subnet) SUBNET="$2"; shift 2 ;;
        --subnet=*) SUBNET="${1#*=}"; shift ;;
        --prefix) PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --mpirun-arg) MPIRUN_EXTRA+=("$2"); shift 2 ;;
        --mpirun-arg=*) MPIRUN_EXTRA+=("${1#*=}"); shift ;;
        --keep) KEEP=1; shift ;;
        --no-tcp-tuning) TCP_TUNING=0; shift ;;
        --per-flow) PER_FLOW=1; shift ;;
        --cleanup-only) CLEANUP_ONLY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) echo "emulated_cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ ${#RATES[@]} -gt 0 ] || RATES=(100mbit)

case "$SUBNET" in
    10.*|192.168.*|172.1[6-9].*|172.2[0-9].*|172.3[01].*) ;;
    *) echo "emulated_cluster.sh: --subnet must be a private range (10/8, 172.16/12, 192.168/16)" >&2
       exit 2 ;;
esac
if ! [[ "$HOSTS" =~ ^[0-9]+$ ]] || [ "$HOSTS" -lt 1 ] || [ "$HOSTS" -gt 200 ]; then
    echo "emulated_cluster.sh: --hosts must be in 1..200" >&2; exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "emulated_cluster.sh: needs root (network namespaces and tc)" >&2; exit 1
fi
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "emulated_cluster.sh: installing iproute2" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
command -v unshare >/dev/null || { echo "emulated_cluster.sh: unshare (util-linux) missing" >&2; exit 1; }

CTL="${PREFIX}ctl"
NAMES=()
for ((i = 0; i < HOSTS; i++)); do NAMES+=("${PREFIX}${i}"); done
WORKDIR=""
MARKER="# written by benchmarks/emulated_cluster.sh"

cleanup() {
    set +e
    for ns in "${NAMES[@]}" "$CTL"; do
        if [ -e "/var/run/netns/$ns" ]; then
            # Leftover processes in the namespace (a hung rank) would keep it alive.
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
            ip netns del "$ns" 2>/dev/null
        fi
        # Only the per-namespace hosts files this script writes (they carry its marker).
        if head -n 1 "/etc/netns/$ns/hosts" 2>/dev/null | grep -qx "$MARKER"; then
            rm -f "/etc/netns/$ns/hosts"
            rmdir "/etc/netns/$ns" 2>/dev/null
        fi
    done
    rmdir /etc/netns 2>/dev/null
    [ -n "$WORKDIR" ] && rm -rf "$WORKDIR"
}

if [ "$CLEANUP_ONLY" = 1 ]; then cleanup; exit 0; fi

for ns in "${NAMES[@]}" "$CTL"; do
    if [ -e "/var/run/netns/$ns" ]; then
        echo "emulated_cluster.sh: network namespace $ns exists already; remove it" \
             "(--cleanup-only) or pick another --prefix" >&2
        exit 1
    fi
done

CHILD=""
on_signal() {
    # Stop the mpirun this script started; cleanup (EXIT) kills what is left in the namespaces.
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
    exit 130
}
if [ "$KEEP" = 0 ]; then trap cleanup EXIT; fi
trap on_signal INT TERM

WORKDIR="$(mktemp -d /tmp/emulated_cluster.XXXXXX)"

# --- namespaces, bridge, links ------------------------------------------------------------
ip netns add "$CTL"
ip -n "$CTL" link set lo up
ip -n "$CTL" link add br0 type bridge
ip -n "$CTL" addr add "$SUBNET.254/24" dev br0
ip -n "$CTL" link set br0 up

HOSTS_FILE="$WORKDIR/hosts"
{
    echo "$MARKER"
    echo "127.0.0.1 localhost"
    echo "$SUBNET.254 $CTL"
    for ((i = 0; i < HOSTS; i++)); do echo "$SUBNET.$((i + 1)) ${NAMES[$i]}"; done
} >"$HOSTS_FILE"

for ((i = 0; i < HOSTS; i++)); do
    ns="${NAMES[$i]}"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Create the pair inside hctl, then move one end into the host's namespace.
    ip -n "$CTL" link add "p$i" type veth peer name "eth0-$ns"
    ip -n "$CTL" link set "eth0-$ns" netns "$ns"
    ip -n "$ns" link set "eth0-$ns" name eth0
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$CTL" link set "p$i" master br0
    ip -n "$CTL" link set "p$i" up
done

# ip netns exec bind-mounts /etc/netns/<ns>/* over /etc: every namespace resolves the
# emulated host names without touching the machine's /etc/hosts.
for ns in "${NAMES[@]}" "$CTL"; do
    if [ -e "/etc/netns/$ns" ]; then
        echo "emulated_cluster.sh: /etc/netns/$ns exists already; not overwriting it" >&2
        exit 1
    fi
    mkdir -p "/etc/netns/$ns"
    cp "$HOSTS_FILE" "/etc/netns/$ns/hosts"
done

per_flow() {  # per_flow NS RATE: htb + u32 per-connection classes on NS's eth0 (see --per-flow)
    local ns="$1" rate="$2" n batch
    batch="$WORKDIR/tc_$ns"
    {
        echo "qdisc replace dev eth0 root handle 1: htb default 1"
        echo "class add dev eth0 parent 1: classid 1:1 htb rate 10gbit"
        echo "filter add dev eth0 parent 1: prio 1 handle 2: protocol ip u32 divisor 256"
        echo "filter add dev eth0 parent 1: prio 1 handle 3: protocol ip u32 divisor 256"
        for ((n = 0; n < 256; n++)); do
            printf 'class add dev eth0 parent 1: classid 1:%x htb rate %s\n' $((0x1000 + n)) "$rate"
            printf 'class add dev eth0 parent 1: classid 1:%x htb rate %s\n' $((0x2000 + n)) "$rate"
            printf 'filter add dev eth0 parent 1: prio 1 protocol ip u32 ht 2:%x: match u32 0 0 flowid 1:%x\n' $n $((0x1000 + n))
            printf 'filter add dev eth0 parent 1: prio 1 protocol ip u32 ht 3:%x: match u32 0 0 flowid 1:%x\n' $n $((0x2000 + n))
        done
        # From a listening port (50000-50015): hash the peer's port (destination), else ours.
        echo "filter add dev eth0 parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff match ip sport 50000 0xfff0 hashkey mask 0x000000ff at 20 link 2:"
        echo "filter add dev eth0 parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff hashkey mask 0x00ff0000 at 20 link 3:"
    } >"$batch"
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$ns" tc -batch "$batch"
}

shape() {  # shape RATE: tbf on both ends of every link, or none for "unshaped"
    local rate="$1"
    for ((i = 0; i < HOSTS; i++)); do
        if [ "$rate" = unshaped ]; then
            ip netns exec "${NAMES[$i]}" tc qdisc del dev eth0 root 2>/dev/null || true
            ip netns exec "$CTL" tc qdisc del dev "p$i" root 2>/dev/null || true
        elif [ "$PER_FLOW" = 1 ]; then
            per_flow "${NAMES[$i]}" "$rate"
            ip netns exec "$CTL" tc qdisc del dev "p$i" root 2>/dev/null || true
        else
            ip netns exec "${NAMES[$i]}" tc qdisc replace dev eth0 root tbf \
                rate "$rate" burst 512kb latency 100ms
            ip netns exec "$CTL" tc qdisc replace dev "p$i" root tbf \
                rate "$rate" burst 512kb latency 100ms
        fi
    done
}

# --- the rsh agent: "agent HOST COMMAND..." runs COMMAND in HOST's namespace ---------------
AGENT="$WORKDIR/netns_agent.sh"
cat >"$AGENT" <<'EOF'
#!/bin/sh
# Open MPI's rsh agent for the emulated cluster: $1 is the host (= namespace) name, the rest
# is the command line an ssh would hand to the remote shell.
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
EOF
chmod +x "$AGENT"

HOSTLIST=""
for ns in "${NAMES[@]}"; do HOSTLIST="${HOSTLIST:+$HOSTLIST,}$ns:1"; done

if command -v ping >/dev/null; then
    for ((i = 0; i < HOSTS; i++)); do
        ip netns exec "$CTL" ping -c 1 -W 2 "$SUBNET.$((i + 1))" >/dev/null 2>&1 \
            || echo "emulated_cluster.sh: warning: ${NAMES[$i]} does not answer ping" >&2
    done
fi

if [ "$KEEP" = 1 ]; then
    echo "emulated_cluster.sh: --keep: rsh agent for manual mpirun runs: $AGENT" >&2
fi
if [ $# -eq 0 ]; then
    echo "emulated_cluster.sh: no command given; the cluster was set up and works." >&2
    exit 0
fi

status=0
for rate in "${RATES[@]}"; do
    shape "$rate"
    label="links ${rate}"
    [ "$PER_FLOW" = 1 ] && label="${rate} per TCP connection"
    echo "=== emulated cluster: ${HOSTS} hosts (${NAMES[*]}), ${label} ===" >&2
    # mpirun itself runs in hctl (on the bridge, no rank there) under a host name of its own.
    MPIRUN=(mpirun --allow-run-as-root
            --host "$HOSTLIST" -np "$HOSTS"
            --mca plm_rsh_agent "$AGENT"
            --mca pml ob1 --mca btl tcp,self
            --mca btl_tcp_if_include "$SUBNET.0/24"
            --prtemca oob_tcp_if_include "$SUBNET.0/24"
            --bind-to none
            -x EMU_LINK_RATE -x EMU_PER_FLOW -x EMU_NET_IF -x PATH -x PYTHONPATH
            "${MPIRUN_EXTRA[@]}")
    [ "$TCP_TUNING" = 1 ] && MPIRUN+=(--mca btl_tcp_flags send)
    [ "$PER_FLOW" = 1 ] && MPIRUN+=(--mca btl_tcp_port_min_v4 50000 --mca btl_tcp_port_range_v4 16)
    # In the background and waited for, so that a signal reaches the trap at once.
    EMU_LINK_RATE="$rate" EMU_PER_FLOW="$PER_FLOW" EMU_NET_IF=eth0 PYTHONPATH="${PYTHONPATH:-}" \
        ip netns exec "$CTL" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$CTL" \
        "${MPIRUN[@]}" "$@" &
    CHILD=$!
    wait "$CHILD" || status=$?
    CHILD=""
    if [ "$status" != 0 ]; then
        echo "emulated_cluster.sh: the command failed at $rate (exit $status)" >&2
        break
    fi
done
exit "$status"
