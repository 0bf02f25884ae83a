"""Whether a key or secret file given to a service is closed to others.

Only its owner may read it, except that a file root owns may also be read by its group
(PostgreSQL's rule for its key file). That is how Kubernetes mounts a Secret for a pod with
an fsGroup: root's, group fsGroup, 0440 whatever defaultMode asks (fsGroup adds group read),
behind a symlink into ..data on a read-only mount. Root, unlike another user, could read the
file anyway; its group is the pod's."""

from __future__ import annotations

import os


def open_to_others(st: os.stat_result) -> bool:
    """Whether anyone but the owner may read or change the file ``st`` describes (a root-owned
    file's group may read it)."""
    return bool(st.st_mode & (0o077 if st.st_uid != 0 else 0o037))


def given_by_root(st: os.stat_result) -> bool:
    """A root-owned file closed to others (a Kubernetes Secret's mount): not another user's choice."""
    return st.st_uid == 0 and not open_to_others(st)
