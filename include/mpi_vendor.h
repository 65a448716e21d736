/* Which MPI implementation's mpi.h this extension was compiled against, and its version, so
 * that dynar can refuse to run it beside an mpi4py that loaded a different (ABI-incompatible)
 * MPI library (dynar/dist/runtime.py compares them with MPI_Get_library_version). */
#ifndef DYNAR_MPI_VENDOR_H
#define DYNAR_MPI_VENDOR_H
#include <mpi.h>

#define DYNAR_STRINGIFY_(x) #x
#define DYNAR_STRINGIFY(x) DYNAR_STRINGIFY_(x)

#if defined(I_MPI_VERSION)
#define DYNAR_MPI_VENDOR "Intel MPI"
#define DYNAR_MPI_VERSION I_MPI_VERSION
#elif defined(MVAPICH2_VERSION)
#define DYNAR_MPI_VENDOR "MVAPICH"
#define DYNAR_MPI_VERSION MVAPICH2_VERSION
#elif defined(MVAPICH_VERSION)
#define DYNAR_MPI_VENDOR "MVAPICH"
#define DYNAR_MPI_VERSION MVAPICH_VERSION
#elif defined(OMPI_MAJOR_VERSION)
#define DYNAR_MPI_VENDOR "Open MPI"
#define DYNAR_MPI_VERSION DYNAR_STRINGIFY(OMPI_MAJOR_VERSION) "." \
    DYNAR_STRINGIFY(OMPI_MINOR_VERSION) "." DYNAR_STRINGIFY(OMPI_RELEASE_VERSION)
#elif defined(MPICH_VERSION)
#define DYNAR_MPI_VENDOR "MPICH"
#define DYNAR_MPI_VERSION MPICH_VERSION
#else
#define DYNAR_MPI_VENDOR "unknown"
#define DYNAR_MPI_VERSION "unknown"
#endif

#endif
