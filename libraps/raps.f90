! libraps from Fortran: the C calls of raps.h through ISO_C_BINDING (docs/c-api.md).
! Every function returns RAPS_OK (0) or an error code; raps_error_message() says why.
module raps
  use, intrinsic :: iso_c_binding
  implicit none
  private
  public :: raps_init, raps_mem_protect, raps_mem_unprotect, raps_checkpoint, &
            raps_restart_test, raps_restore, raps_progress, raps_checkpoint_due, &
            raps_finalize, raps_error_message, raps_restart_labels, raps_restart_choose, &
            raps_restore_version
  integer(c_int), parameter, public :: RAPS_OK = 0, RAPS_ERR_NO_AGENT = 3, &
       RAPS_ERR_REFUSED = 4, RAPS_ERR_PERMISSION = 5, RAPS_ERR_WRONG_JOB = 6, &
       RAPS_ERR_QUOTA = 7, RAPS_ERR_NO_CHECKPOINT = 8, RAPS_ERR_MISMATCH = 13, &
       RAPS_MAX_LABELS = 64

  interface
    function raps_init() bind(c, name="raps_init") result(rc)
      import :: c_int
      integer(c_int) :: rc
    end function
    function c_protect(id, ptr, count, elem) bind(c, name="raps_mem_protect") result(rc)
      import :: c_int, c_ptr, c_size_t
      integer(c_int), value :: id
      type(c_ptr), value :: ptr
      integer(c_size_t), value :: count, elem
      integer(c_int) :: rc
    end function
    function raps_mem_unprotect(id) bind(c, name="raps_mem_unprotect") result(rc)
      import :: c_int
      integer(c_int), value :: id
      integer(c_int) :: rc
    end function
    function raps_checkpoint(version) bind(c, name="raps_checkpoint") result(rc)
      import :: c_int, c_long
      integer(c_long), value :: version
      integer(c_int) :: rc
    end function
    function raps_restart_test(version) bind(c, name="raps_restart_test") result(rc)
      import :: c_int, c_long
      integer(c_long), intent(out) :: version
      integer(c_int) :: rc
    end function
    function raps_restore(version) bind(c, name="raps_restore") result(rc)
      import :: c_int, c_long
      integer(c_long), intent(out) :: version
      integer(c_int) :: rc
    end function
    !> The labels of this rank's generations, newest first (at most cap).
    function raps_restart_labels(labels, cap, count) bind(c, name="raps_restart_labels") &
        result(rc)
      import :: c_int, c_long
      integer(c_long), intent(out) :: labels(*)
      integer(c_int), value :: cap
      integer(c_int), intent(out) :: count
      integer(c_int) :: rc
    end function
    !> Make raps_restore restore the newest generation labelled version (-1: the newest).
    function raps_restart_choose(version) bind(c, name="raps_restart_choose") result(rc)
      import :: c_int, c_long
      integer(c_long), value :: version
      integer(c_int) :: rc
    end function
    function raps_restore_version(version) bind(c, name="raps_restore_version") result(rc)
      import :: c_int, c_long
      integer(c_long), value :: version
      integer(c_int) :: rc
    end function
    function raps_progress(step) bind(c, name="raps_progress") result(rc)
      import :: c_int, c_long
      integer(c_long), value :: step
      integer(c_int) :: rc
    end function
    function raps_checkpoint_due(due) bind(c, name="raps_checkpoint_due") result(rc)
      import :: c_int
      integer(c_int), intent(out) :: due
      integer(c_int) :: rc
    end function
    function raps_finalize() bind(c, name="raps_finalize") result(rc)
      import :: c_int
      integer(c_int) :: rc
    end function
    function c_last_error() bind(c, name="raps_last_error") result(p)
      import :: c_ptr
      type(c_ptr) :: p
    end function
    function c_strlen(s) bind(c, name="strlen") result(n)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: n
    end function
  end interface

contains

  !> Protect nbytes bytes at the contiguous array whose first element is x (c_loc(x)),
  !> elements of elem bytes (e.g. 8 for real(8)).
  function raps_mem_protect(id, ptr, nbytes, elem) result(rc)
    integer, intent(in) :: id
    type(c_ptr), intent(in) :: ptr
    integer(c_size_t), intent(in) :: nbytes, elem
    integer(c_int) :: rc
    rc = c_protect(int(id, c_int), ptr, nbytes / elem, elem)
  end function

  !> The message of the last failed call ("" after success).
  function raps_error_message() result(msg)
    character(len=:), allocatable :: msg
    character(kind=c_char), pointer :: chars(:)
    type(c_ptr) :: p
    integer :: i, n
    p = c_last_error()
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: msg)
    do i = 1, n
      msg(i:i) = chars(i)
    end do
  end function
end module raps
