! A 2-D heat stencil that checkpoints through libraps: the pattern of examples/c/heat.c.
!
! The NX x NY plate is cut into bands of columns (Fortran keeps columns contiguous), one
! per rank; each step swaps halo columns with the neighbours (MPI_Sendrecv), relaxes the
! interior (Jacobi) and sums the squared change (MPI_Allreduce). Every EVERY steps the
! ranks checkpoint their band and the step; at start they restore the newest generation
! every rank committed (the common label), if any. Rank 0 prints the residual and a hash of the whole plate.
!
!   mpirun -np 4 ./heat [NX NY STEPS EVERY]        (defaults 256 256 400 50)
!   RAPS_HEAT_CRASH_AT=K: the last rank exits at the start of step K, as a lost node.
program heat
  use, intrinsic :: iso_c_binding
  use mpi
  use raps
  implicit none
  integer :: nx = 256, ny = 256, rank, nranks, ierr, cols, left, right, i, j, rc
  integer(c_int) :: nlabels
  integer(c_long), target :: step = 0
  integer(c_long) :: steps = 400, every = 50, crash_at = -1, mine, lo, common
  integer(c_long) :: labels(RAPS_MAX_LABELS)
  real(c_double), allocatable, target :: u(:, :), v(:, :), plate(:, :)
  real(c_double) :: local, residual = 0
  character(len=32) :: arg

  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks, ierr)
  if (command_argument_count() >= 4) then
    call get_command_argument(1, arg); read (arg, *) nx
    call get_command_argument(2, arg); read (arg, *) ny
    call get_command_argument(3, arg); read (arg, *) steps
    call get_command_argument(4, arg); read (arg, *) every
  end if
  call get_environment_variable("RAPS_HEAT_CRASH_AT", arg, status=rc)
  if (rc == 0 .and. len_trim(arg) > 0) read (arg, *) crash_at
  if (mod(ny, nranks) /= 0 .or. nx < 3) then
    if (rank == 0) write (0, *) "heat: NY must be a multiple of the ranks, NX >= 3"
    call MPI_Abort(MPI_COMM_WORLD, 2, ierr)
  end if
  cols = ny / nranks
  left = merge(MPI_PROC_NULL, rank - 1, rank == 0)
  right = merge(MPI_PROC_NULL, rank + 1, rank == nranks - 1)
  allocate(u(nx, 0:cols + 1), v(nx, 0:cols + 1))
  u = 0; v = 0
  if (rank == 0) u(:, 0) = 100

  call must(raps_init(), "raps_init")
  call must(raps_mem_protect(0, c_loc(u), int(8 * size(u), c_size_t), 8_c_size_t), "protect")
  call must(raps_mem_protect(1, c_loc(step), 8_c_size_t, 8_c_size_t), "protect")
  ! the common generation: the newest label every rank holds. Each round every rank
  ! offers its newest label at most the candidate; the minimum is the next candidate.
  nlabels = 0
  rc = raps_restart_labels(labels, RAPS_MAX_LABELS, nlabels)
  if (rc /= RAPS_OK .and. rc /= RAPS_ERR_NO_CHECKPOINT) call must(rc, "raps_restart_labels")
  common = huge(common)
  do
    mine = -1
    do i = 1, nlabels
      if (labels(i) <= common) mine = max(mine, labels(i))
    end do
    call MPI_Allreduce(mine, lo, 1, MPI_LONG, MPI_MIN, MPI_COMM_WORLD, ierr)
    if (lo < 0 .or. lo == common) exit
    common = lo
  end do
  if (lo >= 0) then
    call must(raps_restore_version(common), "raps_restore_version")
    if (rank == 0) write (*, '(a,i0)') "restored step ", step
  end if

  do while (step < steps)
    if (step == crash_at .and. rank == nranks - 1) call exit(3)
    call MPI_Sendrecv(u(:, cols), nx, MPI_DOUBLE_PRECISION, right, 0, u(:, 0), nx, &
         MPI_DOUBLE_PRECISION, left, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE, ierr)
    call MPI_Sendrecv(u(:, 1), nx, MPI_DOUBLE_PRECISION, left, 1, u(:, cols + 1), nx, &
         MPI_DOUBLE_PRECISION, right, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE, ierr)
    if (rank == 0) u(:, 0) = 100
    local = 0
    do j = 1, cols
      do i = 2, nx - 1
        v(i, j) = u(i, j) + 0.2d0 * (u(i - 1, j) + u(i + 1, j) + u(i, j - 1) + u(i, j + 1) &
             - 4 * u(i, j))
        local = local + (v(i, j) - u(i, j))**2
      end do
    end do
    u(2:nx - 1, 1:cols) = v(2:nx - 1, 1:cols)
    call MPI_Allreduce(local, residual, 1, MPI_DOUBLE_PRECISION, MPI_SUM, MPI_COMM_WORLD, ierr)
    step = step + 1
    call must(raps_progress(step), "raps_progress")
    if (mod(step, every) == 0) call must(raps_checkpoint(step), "raps_checkpoint")
  end do

  allocate(plate(nx, ny))
  call MPI_Gather(u(:, 1:cols), nx * cols, MPI_DOUBLE_PRECISION, plate, nx * cols, &
       MPI_DOUBLE_PRECISION, 0, MPI_COMM_WORLD, ierr)
  if (rank == 0) write (*, '(a,i0,a,es25.17,a,z16.16)') "final step ", step, " residual ", &
       residual, " hash ", fnv(plate)
  call must(raps_finalize(), "raps_finalize")
  call MPI_Finalize(ierr)

contains

  subroutine must(rc, what)
    integer(c_int), intent(in) :: rc
    character(len=*), intent(in) :: what
    if (rc /= RAPS_OK) then
      write (0, *) "heat: ", what, ": ", raps_error_message()
      call MPI_Abort(MPI_COMM_WORLD, 2, ierr)
    end if
  end subroutine

  !> FNV-1a over the plate's bytes (wrapping 64-bit arithmetic done in two halves).
  function fnv(a) result(h)
    real(c_double), intent(in), target :: a(:, :)
    integer(c_int64_t) :: h
    integer(c_int8_t), pointer :: b(:)
    integer :: k
    call c_f_pointer(c_loc(a), b, [8 * size(a)])
    h = int(z'CBF29CE484222325', c_int64_t)
    do k = 1, size(b)
      h = ieor(h, int(iand(int(b(k), c_int64_t), 255_c_int64_t), c_int64_t))
      h = mulmod(h)
    end do
  end function

  !> h * 1099511628211 modulo 2**64, without signed overflow.
  function mulmod(h) result(r)
    integer(c_int64_t), intent(in) :: h
    integer(c_int64_t) :: r, lo32, hi32
    lo32 = iand(h, int(z'FFFFFFFF', c_int64_t))
    hi32 = ishft(h, -32)
    ! 1099511628211 = 2**40 + 435
    r = ishft(h, 40) + lo32 * 435 + ishft(iand(hi32 * 435, int(z'FFFFFFFF', c_int64_t)), 32)
  end function
end program heat
