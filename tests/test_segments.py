"""Which shared-memory files of the MPI library a rank removes when its job ends without
MPI_Finalize (comm/segments.py); the jobs that end so are in test_training and test_sentinel."""

from psgrad.runtime import segments


def _maps(tmp_path, lines: list[str]):
    path = tmp_path / "maps"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def test_job_segments_are_the_mpi_librarys_files_in_dev_shm_still_there(tmp_path):
    row = "7f0000000000-7f0000300000 rw-s 00000000 00:1a 1234                       "
    maps = _maps(
        tmp_path,
        [
            f"{row}/dev/shm/mpich_shm_1a2b_0",
            f"{row}/dev/shm/mpich_shm_1a2b_0",  # mapped twice: listed once
            f"{row}/dev/shm/mpich_shm_dead_0 (deleted)",  # unlinked already
            f"{row}/dev/shm/ucx_shm_posix_99",  # another library's: not ours to remove
            f"{row}/dev/shm/torch_1234_5678",
            f"{row}/tmp/mpich_shm_elsewhere_0",
            "7f0000300000-7f0000301000 r--p 00000000 00:00 0 ",
            "7f0000301000-7f0000302000 r-xp 00000000 08:01 99                         /usr/lib/libc.so.6",
        ],
    )
    assert segments.job_segments(maps) == ["/dev/shm/mpich_shm_1a2b_0"]


def test_no_maps_no_segments(tmp_path):
    assert segments.job_segments(str(tmp_path / "absent")) == []


def test_remove_unlinks_and_takes_a_file_already_gone_in_its_stride(tmp_path):
    there = tmp_path / "mpich_shm_1_0"
    there.write_bytes(b"x")
    segments.remove([str(tmp_path / "mpich_shm_gone_0"), str(there)])
    assert not there.exists()


def test_this_process_lists_a_mapped_segment_and_not_once_removed(tmp_path, monkeypatch):
    """Against the real /proc/self/maps: a file mapped from the shared-memory directory is listed
    while it is there, and no longer once it is unlinked (the mapping stays usable)."""
    import mmap

    monkeypatch.setattr(segments, "SHM_DIR", str(tmp_path))
    path = tmp_path / "mpich_shm_test_0"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE) as mapped:
        assert segments.job_segments() == [str(path)]
        segments.remove(segments.job_segments())
        assert not path.exists() and segments.job_segments() == []
        mapped[0] = 1  # still the rank's memory
