// One Muon step and one AdamW step through the installed headers and library: the weights must
// move, stay finite, and the engine must count one step.
#include <distmuon/engine.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using namespace distmuon;
  auto backend = make_backend("cpu");
  Engine engine(*backend);
  GroupOptions muon;
  muon.muon.ortho = parse_algorithm("auto");
  GroupOptions adamw;
  adamw.kind = ParamKind::kAdamW;
  const int gm = engine.add_group(muon), ga = engine.add_group(adamw);
  engine.add_param({"layer0.mlp.weight", gm, {48, 16}, DType::kF32});
  engine.add_param({"layer0.mlp.bias", ga, {48}, DType::kF32});

  std::vector<float> w(48 * 16, 0.5f), gw(48 * 16), b(48, 0.0f), gb(48, 1.0f);
  for (size_t i = 0; i < gw.size(); ++i) gw[i] = std::sin(0.1f * static_cast<float>(i));
  const std::vector<float> w0 = w;
  std::vector<ParamData> data = {{w.data(), gw.data(), DType::kF32},
                                 {b.data(), gb.data(), DType::kF32}};
  engine.step(data);

  double moved = 0;
  bool finite = true;
  for (size_t i = 0; i < w.size(); ++i) {
    moved += std::abs(w[i] - w0[i]);
    finite = finite && std::isfinite(w[i]);
  }
  const EngineStats st = engine.stats();
  std::printf("distmuon %s: weight moved %.4g, bias[0] %.4g, steps %lld\n", DISTMUON_VERSION, moved,
              b[0], static_cast<long long>(st.steps));
  return finite && moved > 0 && b[0] < 0 && st.steps == 1 ? 0 : 1;
}
