// The job id an efdl command run inside a Slurm allocation defaults to, when neither --job nor
// EFDL_JOB_ID gives one (issue #36, docs/slurm.md): "slurm-<SLURM_JOB_ID>". Slurm's job id is the
// same in the batch script and in every step and node of the allocation, and a requeued job keeps
// it, so every `efdl run` of one allocation and of its requeued runs is one EFDL job. Not the job
// name: Slurm's default name is the script's file name, shared by unrelated jobs.
#pragma once

#include <string>
#include <string_view>

namespace efdl::cli {

// "slurm-<id>" for a SLURM_JOB_ID value of digits (with an array job's "_<task>" suffix kept as
// "-<task>"); "" for an empty or malformed value (then the command's own rule applies).
std::string SlurmJobId(std::string_view slurm_job_id);

// SlurmJobId of this process' SLURM_JOB_ID ("" outside Slurm).
std::string SlurmJobIdFromEnv();

// The line a command that needs a job id prints when it has none.
inline constexpr const char* kJobIdMissing =
    "--job is required: give the job id with --job ID (or set EFDL_JOB_ID); inside a Slurm job "
    "it defaults to slurm-$SLURM_JOB_ID";

}  // namespace efdl::cli
