// Which members of a group can share memory (docs/comm.md, "Shared memory among co-located
// workers"). Torch-free.
//
// Note [Locality key]: two processes may use a shared segment when their keys are equal. The key
// is "<boot id>/net:<inode>/pid:<inode>/uid:<euid>":
//  - the boot id (/proc/sys/kernel/random/boot_id) names the running kernel: equal ids mean one
//    machine and one boot, which a host name does not promise (containers share names, hosts
//    are renamed, two boots of one host are not one memory);
//  - the network namespace's inode: a job started in separate network namespaces of one machine
//    is treated as separate hosts, as the multi-host tests (and containers with their own
//    network) expect; their traffic is meant to cross the network;
//  - the pid namespace's inode: members name each other by pid, both to open the creator's
//    segment (/proc/<pid>/fd/<fd>, Note [Segment by /proc]) and to watch each other's liveness;
//    a pid means nothing in another pid namespace;
//  - the effective uid: opening another process's fd through /proc needs ptrace-read access to it,
//    which the same user has (and root has for anyone, but then not symmetrically).
// The mount and IPC namespaces are left out on purpose: a memfd has no name in any file system
// and is no System V / POSIX IPC object, and a futex on a MAP_SHARED page is keyed by the page,
// not by a namespace, so neither namespace can separate members that the key puts together.
#pragma once

#include <string>

namespace shoal::comm::shm {

// This process's key (Note [Locality key]), as of now. Raises shoal::CommError (one line) when
// /proc cannot tell it, e.g. /proc is not mounted.
std::string locality_key();

// The running kernel's boot id; raises shoal::CommError when unreadable.
const std::string& boot_id();

}  // namespace shoal::comm::shm
