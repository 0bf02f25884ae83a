"""Files and folders another local user could plant: a secret file, the socket folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from common.bearer import read_secret
from common.private_files import given_by_root, open_to_others
from engine.tiers.client import _foreign_socket_folder
from tierstore.auth import AccessError, private_dir


def test_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    assert read_secret(secret) == b"x" * 32
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(secret, 65534, 65534)  # whoever made the file would have chosen the secret
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        read_secret(secret)


def stat_of(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, 10001, 32, 0, 0, 0))


@pytest.mark.parametrize("mode, uid, open_, by_root", [
    (0o600, 10001, False, False), (0o400, 10001, False, False), (0o640, 10001, True, False),
    (0o604, 10001, True, False), (0o440, 10001, True, False),
    (0o600, 0, False, True), (0o440, 0, False, True),  # a Kubernetes Secret mounted for an fsGroup
    (0o460, 0, True, False), (0o444, 0, True, False), (0o640, 0, False, True), (0o660, 0, True, False),
    (0o441, 0, True, False)])
def test_only_the_owner_may_read_a_private_file_or_the_group_of_root_s(mode: int, uid: int, open_: bool,
                                                                       by_root: bool) -> None:
    assert open_to_others(stat_of(mode, uid)) is open_
    assert given_by_root(stat_of(mode, uid)) is by_root


@pytest.mark.skipif(os.getuid() != 0, reason="making a root-owned file for another user needs root")
def test_a_secret_root_gave_to_its_group_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    os.chown(secret, 0, 10001)
    os.chmod(secret, 0o440)
    monkeypatch.setattr(os, "getuid", lambda: 10001)  # read as uid 10001, in group 10001
    assert read_secret(secret) == b"x" * 32
    os.chmod(secret, 0o444)
    with pytest.raises(ValueError, match="root's and open to others"):
        read_secret(secret)


def test_the_engine_does_not_connect_through_a_folder_others_can_write(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    address = f"unix:{folder}/tierstore.sock"
    assert _foreign_socket_folder(address) is None
    folder.chmod(0o777)
    assert "not a private folder" in (_foreign_socket_folder(address) or "")
    folder.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    assert "not a private folder" in (_foreign_socket_folder(f"unix:{link}/tierstore.sock") or "")
    assert _foreign_socket_folder("127.0.0.1:50061") is None


def test_a_symlinked_socket_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    private_dir(real, fix=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    private_dir(link, fix=True)  # the disk tier may live behind a link
    with pytest.raises(AccessError, match="symbolic link"):
        private_dir(link, fix=True, follow_symlinks=False)
