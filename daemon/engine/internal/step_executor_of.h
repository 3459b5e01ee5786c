#pragma once

// Tests only: drives an engine's steps directly, as its StepRunner does (step_test.cc and its
// neighbours form steps by hand). The edges never include this (tests/layering checks it).

#include "daemon/engine/engine.h"
#include "daemon/engine/step_executor.h"

namespace kvpool::daemon {

// The engine as its runner sees it.
StepExecutor& StepExecutorOf(Engine& engine);

}  // namespace kvpool::daemon
