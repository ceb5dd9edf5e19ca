// A compiled unit's loader (AOTInductor's package loader, torch's own C++ class) whose runs release Python's GIL.
//
// torch's Python binding of the loader runs the compiled code holding the GIL, so while a decoder step runs no
// other Python thread of the process can: fastgen-serve's event loop (requests, JSON, tokenizing, answers) and
// fairseq-interactive's reader of input lines (streamed decoders) wait for each step. Eager torch operations
// release the GIL; this loader does the same around the compiled code (which touches no Python object). The other
// methods are torch's, passed through. Built on first use by engine/unlocked_loader.py.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/extension.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace {

class UnlockedLoader {
 public:
  explicit UnlockedLoader(const std::string& package_path) : loader_(package_path, "model", false, 1, -1) {}

  // the unit's outputs for its flat inputs (the loader takes ownership of its copy of the list)
  std::vector<at::Tensor> boxed_run(std::vector<at::Tensor> inputs) {
    pybind11::gil_scoped_release unlocked;
    return loader_.boxed_run(std::move(inputs));
  }

  std::vector<std::string> get_call_spec() { return loader_.get_call_spec(); }

  std::vector<std::string> get_constant_fqns() { return loader_.get_constant_fqns(); }

  void load_constants(std::unordered_map<std::string, at::Tensor> constants, bool use_inactive,
                      bool check_full_update, bool user_managed) {
    loader_.load_constants(constants, use_inactive, check_full_update, user_managed);
  }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<UnlockedLoader>(module, "UnlockedLoader")
      .def(pybind11::init<const std::string&>())
      .def("boxed_run", &UnlockedLoader::boxed_run)
      .def("get_call_spec", &UnlockedLoader::get_call_spec)
      .def("get_constant_fqns", &UnlockedLoader::get_constant_fqns)
      .def("load_constants", &UnlockedLoader::load_constants);
}
