// The job's rendezvous key-value store as the API names it: c10d's Store, by pointer, for
// comm::Group::create. Its type stays declared only here, so that the API's headers carry no
// c10d header; a program that makes a store includes <torch/csrc/distributed/c10d/...> itself.
// shoal's own parts open, host and read the job's store through src/comm/store.h.
#pragma once

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}  // namespace c10d

namespace shoal::comm {

using StorePtr = c10::intrusive_ptr<c10d::Store>;

}  // namespace shoal::comm
