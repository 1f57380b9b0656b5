#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/layer.h"

namespace kvpack::cpu {
namespace {

constexpr double kExact = 1e-14;

// One head, d = 2, three keys: closed-form softmax.
TEST(Reference, MatchesClosedFormSoftmax) {
  const float q[2] = {1.0f, -2.0f};
  const float k[6] = {0.5f, 0.25f, -1.0f, 1.0f, 2.0f, 0.0f};
  const float v[6] = {1.0f, 10.0f, 2.0f, 20.0f, 3.0f, 30.0f};
  QueryBlock queries;
  queries.q = q;
  queries.n_q = 1;
  AttentionOptions attention;
  attention.softmax_scale = 0.5f;
  double out[2];
  ReferenceAttention(queries, k, v, nullptr, 3, 1, 2, attention, out);
  const double s[3] = {0.5 * (0.5 - 0.5), 0.5 * (-1.0 - 2.0), 0.5 * 2.0};
  double z = 0.0, o0 = 0.0, o1 = 0.0;
  for (int j = 0; j < 3; ++j) {
    const double e = std::exp(s[j]);
    z += e;
    o0 += e * v[2 * j];
    o1 += e * v[2 * j + 1];
  }
  EXPECT_NEAR(out[0], o0 / z, kExact);
  EXPECT_NEAR(out[1], o1 / z, kExact);
}

TEST(Reference, MasksOtherSequencesAndFutureKeys) {
  const float q[4] = {1.0f, 0.0f, 0.0f, 1.0f};  // two queries, one head, d = 2
  const float k[6] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const float v[6] = {1.0f, 0.0f, 0.0f, 1.0f, 5.0f, 5.0f};
  const int32_t key_seq[3] = {0, 1, 0};
  const int32_t q_seq[2] = {1, 0};
  const int64_t q_pos[2] = {2, 0};
  QueryBlock queries;
  queries.q = q;
  queries.n_q = 2;
  queries.seq_ids = q_seq;
  queries.positions = q_pos;
  AttentionOptions attention;
  attention.causal = true;
  double out[4];
  ReferenceAttention(queries, k, v, key_seq, 3, 1, 2, attention, out);
  EXPECT_NEAR(out[0], 0.0, kExact);  // query 0 (seq 1) sees key 1 only
  EXPECT_NEAR(out[1], 1.0, kExact);
  EXPECT_NEAR(out[2], 1.0, kExact);  // query 1 (seq 0, position 0) sees key 0 only
  EXPECT_NEAR(out[3], 0.0, kExact);
  queries.positions = nullptr;  // positions 0, 1: query 0 now sees no key of its sequence
  ReferenceAttention(queries, k, v, key_seq, 3, 1, 2, attention, out);
  EXPECT_EQ(out[0], 0.0);
  EXPECT_EQ(out[1], 0.0);
}

}  // namespace
}  // namespace kvpack::cpu
