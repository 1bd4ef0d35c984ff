! The Fortran test rank: two regions, two checkpoints, scribble, restore, compare.
! Prints one JSON line with what it saw; exits 1 when a call failed.
program check
  use, intrinsic :: iso_c_binding
  use raps
  implicit none
  integer, parameter :: n = 200000
  real(c_double), allocatable, target :: field(:), want(:)
  integer(c_int), target :: counts(1000), want_counts(1000)
  integer(c_long) :: version, restored
  integer :: i

  allocate(field(n), want(n))
  do i = 1, n
    field(i) = 0.25d0 * i
  end do
  do i = 1, 1000
    counts(i) = 3 * i
  end do
  call must("init", raps_init())
  call must("protect", raps_mem_protect(1, c_loc(field), int(8 * n, c_size_t), 8_c_size_t))
  call must("protect", raps_mem_protect(2, c_loc(counts), 4000_c_size_t, 4_c_size_t))
  call must("checkpoint", raps_checkpoint(1_c_long))
  field(1:500) = field(1:500) + 1.0d0
  counts(7) = -1
  call must("checkpoint", raps_checkpoint(2_c_long))
  want = field
  want_counts = counts
  field = -1.0d0
  counts = 0
  call must("restart_test", raps_restart_test(version))
  call must("restore", raps_restore(restored))
  write (*, '(a,i0,a,i0,a,l1,a)') '{"version":', version, ',"restored":', restored, &
       ',"same":"', all(field == want) .and. all(counts == want_counts), '"}'
  call must("finalize", raps_finalize())

contains

  subroutine must(what, rc)
    character(len=*), intent(in) :: what
    integer(c_int), intent(in) :: rc
    if (rc /= RAPS_OK) then
      write (*, '(a,a,a,i0,a,a,a)') '{"call":"', what, '","rc":', rc, ',"error":"', &
           raps_error_message(), '"}'
      stop 1
    end if
  end subroutine
end program check
