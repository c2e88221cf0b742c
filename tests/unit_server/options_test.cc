// decode_server's option resolution (server/options.h).
#include "server/options.h"

#include <gtest/gtest.h>

namespace sds::server {
namespace {

// --answer_threads=-1 (the default) picks 4 answer threads from 8 usable CPUs up and
// none below; explicit values, 0 included, are kept whatever the host.
TEST(AnswerThreadsFor, AutoDependsOnTheHostExplicitValuesAreKept) {
  EXPECT_EQ(AnswerThreadsFor(-1, 2), 0);
  EXPECT_EQ(AnswerThreadsFor(-1, 7), 0);
  EXPECT_EQ(AnswerThreadsFor(-1, 8), 4);
  EXPECT_EQ(AnswerThreadsFor(-1, 16), 4);
  EXPECT_EQ(AnswerThreadsFor(0, 16), 0);
  EXPECT_EQ(AnswerThreadsFor(2, 2), 2);
  EXPECT_EQ(AnswerThreadsFor(8, 16), 8);
}

}  // namespace
}  // namespace sds::server
