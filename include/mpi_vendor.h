/* Which MPI implementation's mpi.h this extension was compiled against, so that dynar can
 * refuse to run it beside an mpi4py that loaded a different (ABI-incompatible) MPI. */
#ifndef DYNAR_MPI_VENDOR_H
#define DYNAR_MPI_VENDOR_H
#include <mpi.h>

#if defined(I_MPI_VERSION)
#define DYNAR_MPI_VENDOR "Intel MPI"
#elif defined(MVAPICH2_VERSION) || defined(MVAPICH_VERSION)
#define DYNAR_MPI_VENDOR "MVAPICH"
#elif defined(OMPI_MAJOR_VERSION)
#define DYNAR_MPI_VENDOR "Open MPI"
#elif defined(MPICH_VERSION) || defined(MPICH_NAME)
#define DYNAR_MPI_VENDOR "MPICH"
#else
#define DYNAR_MPI_VENDOR "unknown"
#endif

#endif
