/* kernels/cuda/emu/nccl_emu.cpp — NCCL for the CUDA emulator, over MPI: in the emulator device
 * memory is host memory, so ranks that each emulate their own GPU (ULY_EMU_GPUS=own) take the
 * NCCL path of kernels/cuda/comm.cu (communicators from a broadcast unique id, all-reduce,
 * all-gather, reduce-scatter, grouped send/recv on a stream) exactly as on GPU nodes, and the specs check what it moves.
 *
 * A collective starts when it is queued, as on a GPU, once everything its stream was told to wait
 * for has run: its inputs are copied then and MPI moves the copies. Its results land in the
 * output buffers when the stream reaches its end (at once by default; with ULY_EMU_STREAMS=lazy
 * when something waits for the stream), so work that reads them without waiting for the stream
 * sees the old bytes, and work that writes an input after the start does not change what is sent.
 * Every MPI wait progresses every rank's pending transfers, so ranks never wait on each other's
 * queues. The communicator's members are found over MPI_COMM_WORLD: each tells the unique id's
 * creator (its rank 0) its world rank, and gets the whole table back.
 *
 * Failures, for the watchdog's specs (kernels/cuda/comm.cu): a collective's end on the stream is
 * ready only once MPI has moved its data, so a stream query says "not ready" while it is in flight;
 * uly_emu_nccl_stall(1) makes this rank's collectives from then on post nothing and never finish
 * (a hung GPU: its peers wait forever too); uly_emu_nccl_async_error(code) makes
 * ncclCommGetAsyncError report code (a peer's death as NCCL reports it); ncclCommAbort ends every
 * collective of the communicator in flight without landing its data. */
#include "cuda_emu.h"
#include "nccl.h"
#define OMPI_SKIP_MPICXX 1   /* the C API only: no C++ bindings to link */
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <stdio.h>
#include <memory>
#include <vector>

struct uly_emu_nccl { MPI_Comm comm; int rank, size; bool aborted; };

namespace {
const int TAG_TABLE = 31000, TAG_P2P = 31100;
const char MAGIC[8] = "ulyNCCL";

struct id_fields { char magic[8]; int root, serial; };

size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
    }
}

/* what a reduction sums in: bf16 and f16 through f32 (bf16 only: f16 is not used here) */
MPI_Datatype reduce_type(ncclDataType_t t) {
    switch (t) {
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat64: return MPI_DOUBLE;
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    default: return MPI_FLOAT;
    }
}

bool stalled;                           /* uly_emu_nccl_stall */
ncclResult_t async_error = ncclSuccess;  /* uly_emu_nccl_async_error */

/* queues a collective's end on the stream: `land` runs once MPI has completed every request (or
 * never, when the communicator is aborted first); stalled, nothing was posted and it never ends */
void finish_on(cudaStream_t stream, ncclComm_t comm, std::shared_ptr<std::vector<MPI_Request>> reqs,
               std::function<void()> land) {
    bool dead = stalled;
    uly_emu::submit_when(
        stream,
        [comm, reqs, dead]() {
            if (comm->aborted) return true;
            if (dead) return false;
            int done = 0;
            MPI_Testall((int)reqs->size(), reqs->data(), &done, MPI_STATUSES_IGNORE);
            return done != 0;
        },
        [comm, land]() { if (!comm->aborted) land(); });
}

struct p2p { bool send; char *buf; size_t bytes; int peer; ncclComm_t comm; };
int group_depth;
std::vector<p2p> group_ops;
cudaStream_t group_stream;

/* a reduction's staged result (bf16 summed in f32) into recv: avg's division, bf16 rounding */
void land(char *s, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int size) {
    bool bf16 = type == ncclBfloat16;
    if (op == ncclAvg && (bf16 || type == ncclFloat32))
        for (size_t i = 0; i < count; i++) ((float *)s)[i] /= (float)size;
    if (op == ncclAvg && type == ncclFloat64)
        for (size_t i = 0; i < count; i++) ((double *)s)[i] /= size;
    if (bf16)
        for (size_t i = 0; i < count; i++) ((__nv_bfloat16 *)recv)[i] = __float2bfloat16_rn(((float *)s)[i]);
    else
        memcpy(recv, s, count * type_size(type));
}

bool mpi_up() {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    return up && !down;
}

/* the grouped sends and receives: started now (inputs copied), finished when the stream gets there */
ncclResult_t run_group(std::vector<p2p> ops, cudaStream_t stream) {
    if (ops.empty()) return ncclSuccess;
    uly_emu::drain(stream);   /* what the stream waits for first runs before the inputs are read */
    auto reqs = std::make_shared<std::vector<MPI_Request>>(ops.size());
    auto staged = std::make_shared<std::vector<std::vector<char>>>(ops.size());
    for (size_t i = 0; i < ops.size() && !stalled; i++) {
        p2p &o = ops[i];
        (*staged)[i].resize(o.bytes ? o.bytes : 1);
        char *s = (*staged)[i].data();
        if (o.send) memcpy(s, o.buf, o.bytes);
        int rc = o.send ? MPI_Isend(s, (int)o.bytes, MPI_BYTE, o.peer, TAG_P2P, o.comm->comm, &(*reqs)[i])
                        : MPI_Irecv(s, (int)o.bytes, MPI_BYTE, o.peer, TAG_P2P, o.comm->comm, &(*reqs)[i]);
        if (rc != MPI_SUCCESS) return ncclSystemError;
    }
    finish_on(stream, ops[0].comm, reqs, [ops, staged]() {
        for (size_t i = 0; i < ops.size(); i++)
            if (!ops[i].send) memcpy(ops[i].buf, (*staged)[i].data(), ops[i].bytes);
    });
    return ncclSuccess;
}

ncclResult_t p2p_op(bool send, const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                    cudaStream_t stream) {
    if (!comm || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    if (group_depth > 0 && !group_ops.empty() && group_stream != stream) return ncclInvalidUsage;
    p2p o = {send, (char *)buf, count * type_size(type), peer, comm};
    if (group_depth == 0) return run_group(std::vector<p2p>{o}, stream);
    group_stream = stream;
    group_ops.push_back(o);
    return ncclSuccess;
}
} // namespace

extern "C" {
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static int serial;
    if (!mpi_up()) return ncclSystemError;
    id_fields f;
    memcpy(f.magic, MAGIC, sizeof f.magic);
    MPI_Comm_rank(MPI_COMM_WORLD, &f.root);
    f.serial = serial++;
    memset(id, 0, sizeof *id);
    memcpy(id->internal, &f, sizeof f);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    id_fields f;
    memcpy(&f, id.internal, sizeof f);
    if (memcmp(f.magic, MAGIC, sizeof f.magic) || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    if (!mpi_up()) return ncclSystemError;
    int me = 0, tag = TAG_TABLE + 2 * (f.serial % 40);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    if ((rank == 0) != (me == f.root)) return ncclInvalidUsage;   /* the id's maker is rank 0 */
    int mine[2] = {rank, me};
    MPI_Request sent;
    MPI_Isend(mine, 2, MPI_INT, f.root, tag, MPI_COMM_WORLD, &sent);
    std::vector<int> table(nranks, -1);
    if (rank == 0) {
        for (int i = 0; i < nranks; i++) {
            int got[2];
            MPI_Recv(got, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (got[0] >= 0 && got[0] < nranks) table[got[0]] = got[1];
        }
        std::vector<MPI_Request> out(nranks);
        for (int i = 0; i < nranks; i++) MPI_Isend(table.data(), nranks, MPI_INT, table[i], tag + 1, MPI_COMM_WORLD, &out[i]);
        std::vector<int> copy(nranks);
        MPI_Recv(copy.data(), nranks, MPI_INT, f.root, tag + 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Waitall(nranks, out.data(), MPI_STATUSES_IGNORE);
    } else {
        MPI_Recv(table.data(), nranks, MPI_INT, f.root, tag + 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    MPI_Wait(&sent, MPI_STATUS_IGNORE);
    MPI_Group world, members;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_incl(world, nranks, table.data(), &members);
    MPI_Comm c = MPI_COMM_NULL;
    int rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &c);
    MPI_Group_free(&members);
    MPI_Group_free(&world);
    if (rc != MPI_SUCCESS || c == MPI_COMM_NULL) return ncclSystemError;
    *comm = new uly_emu_nccl{c, rank, nranks, false};
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    if (comm->aborted) return ncclInvalidUsage;   /* an aborted handle is gone */
    if (mpi_up()) MPI_Comm_free(&comm->comm);
    delete comm;
    return ncclSuccess;
}

/* as NCCL: the collectives in flight end (here: without landing); the handle is not used again.
 * Nothing is freed, since MPI may still complete a posted transfer into its staging buffers. */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm) comm->aborted = true;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
    if (!comm) return ncclInvalidArgument;
    *err = async_error;
    return ncclSuccess;
}

/* for the watchdog's specs: stall this rank's NCCL (on = 1) from the next collective on; only
 * with ULY_EMU_STREAMS=lazy, where a collective's end waits on its stream (-1 otherwise: at once,
 * the call that queues it would wait forever) */
int uly_emu_nccl_stall(int on) {
    if (on && !uly_emu::lazy()) return -1;
    stalled = on != 0;
    return 0;
}

/* for the watchdog's specs: what ncclCommGetAsyncError reports from now on (0: no error) */
void uly_emu_nccl_async_error(int code) { async_error = (ncclResult_t)code; }

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm) return ncclInvalidArgument;
    *count = comm->size;
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    if (!comm) return ncclInvalidArgument;
    if (group_depth > 0) return ncclInvalidUsage;   /* not needed grouped here */
    if (op != ncclSum && op != ncclMax && op != ncclAvg) return ncclInvalidArgument;
    if (type == ncclFloat16) return ncclInvalidArgument;
    uly_emu::drain(stream);
    bool bf16 = type == ncclBfloat16;
    size_t es = bf16 ? 4 : type_size(type);
    auto staged = std::make_shared<std::vector<char>>(count * es + 1);
    if (bf16)
        for (size_t i = 0; i < count; i++) {
            float v = __bfloat162float(((const __nv_bfloat16 *)send)[i]);
            memcpy(staged->data() + 4 * i, &v, 4);
        }
    else memcpy(staged->data(), send, count * es);
    auto req = std::make_shared<std::vector<MPI_Request>>(1, MPI_REQUEST_NULL);
    MPI_Datatype t = reduce_type(type);
    if (!stalled && MPI_Iallreduce(MPI_IN_PLACE, staged->data(), (int)count, t, op == ncclMax ? MPI_MAX : MPI_SUM,
                                   comm->comm, req->data()) != MPI_SUCCESS)
        return ncclSystemError;
    int size = comm->size;
    finish_on(stream, comm, req, [=]() { land(staged->data(), recv, count, type, op, size); });
    return ncclSuccess;
}

/* send may be recv's own block (in place): it is copied when the collective starts */
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
    if (!comm) return ncclInvalidArgument;
    if (group_depth > 0) return ncclInvalidUsage;
    uly_emu::drain(stream);
    size_t bytes = count * type_size(type);
    auto mine = std::make_shared<std::vector<char>>((const char *)send, (const char *)send + bytes);
    auto all = std::make_shared<std::vector<char>>(bytes * comm->size + 1);
    auto req = std::make_shared<std::vector<MPI_Request>>(1, MPI_REQUEST_NULL);
    if (!stalled && MPI_Iallgather(mine->data(), (int)bytes, MPI_BYTE, all->data(), (int)bytes, MPI_BYTE, comm->comm,
                                   req->data()) != MPI_SUCCESS)
        return ncclSystemError;
    size_t total = bytes * comm->size;
    finish_on(stream, comm, req, [=]() {
        (void)mine;   /* MPI reads it until the collective completes */
        memcpy(recv, all->data(), total);
    });
    return ncclSuccess;
}

/* recv: count elements, this rank's block of the sum (max, avg) of every rank's count * size */
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
    if (!comm) return ncclInvalidArgument;
    if (group_depth > 0) return ncclInvalidUsage;
    if (op != ncclSum && op != ncclMax && op != ncclAvg) return ncclInvalidArgument;
    if (type == ncclFloat16) return ncclInvalidArgument;
    uly_emu::drain(stream);
    bool bf16 = type == ncclBfloat16;
    size_t es = bf16 ? 4 : type_size(type), n_in = count * comm->size;
    auto staged = std::make_shared<std::vector<char>>(n_in * es + 1);
    if (bf16)
        for (size_t i = 0; i < n_in; i++) {
            float v = __bfloat162float(((const __nv_bfloat16 *)send)[i]);
            memcpy(staged->data() + 4 * i, &v, 4);
        }
    else memcpy(staged->data(), send, n_in * es);
    auto out = std::make_shared<std::vector<char>>(count * es + 1);
    auto req = std::make_shared<std::vector<MPI_Request>>(1, MPI_REQUEST_NULL);
    if (!stalled && MPI_Ireduce_scatter_block(staged->data(), out->data(), (int)count, reduce_type(type),
                                              op == ncclMax ? MPI_MAX : MPI_SUM, comm->comm, req->data()) != MPI_SUCCESS)
        return ncclSystemError;
    int size = comm->size;
    finish_on(stream, comm, req, [=]() {
        (void)staged;
        land(out->data(), recv, count, type, op, size);
    });
    return ncclSuccess;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    return p2p_op(true, buf, count, type, peer, comm, stream);
}
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    return p2p_op(false, buf, count, type, peer, comm, stream);
}

ncclResult_t ncclGroupStart(void) { group_depth++; return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) {
    if (group_depth <= 0) return ncclInvalidUsage;
    if (--group_depth > 0) return ncclSuccess;
    std::vector<p2p> ops;
    ops.swap(group_ops);
    return run_group(ops, group_stream);
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "system error (emulated NCCL: MPI is not running or failed)";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    default: return "internal error";
    }
}
}
