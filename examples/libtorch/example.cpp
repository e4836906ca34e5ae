// Train a small network with LibTorch, the C++ API of PyTorch, on the CPU or a GPU.
//
// The program fits a two-layer network to generated data (y = x . w + noise) with a few epochs
// of SGD and prints the loss of each epoch, which goes down. It also prints the LibTorch
// version it was compiled against and whether CUDA is available. Errors end it with one line
// on stderr: exit code 2 for a bad option or a missing GPU, 1 for an error raised by LibTorch.
// In a job that the scheduler gave GPUs, on a node that has them, --device auto stops (exit 2)
// when LibTorch can use none, rather than train on the CPU.
//
//     bash build.sh --device cpu            # configure, build, run (options go to the program)
//     build/example --device cuda --epochs 10
//     sbatch libtorch.sbatch                # build and run on a compute node
#include <torch/torch.h>

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <stdexcept>
#include <string>

namespace {

const char* const kUsage =
    "usage: example [--device auto|cpu|cuda] [--epochs N] [--batch-size N] [--lr X] [--seed N]";

struct Options {
  std::string device = "auto";
  int epochs = 5;
  int batch_size = 64;
  double lr = 0.01;
  int seed = 0;
};

// Thrown for a bad command line; main() prints it and returns 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Options parse_args(int argc, char* argv[]) {
  Options options;
  for (int i = 1; i < argc; i += 2) {
    const std::string name = argv[i];
    if (name == "-h" || name == "--help") {
      std::cout << kUsage << "\n";
      std::exit(0);
    }
    if (i + 1 >= argc) throw UsageError(name + " needs a value (" + kUsage + ")");
    const std::string value = argv[i + 1];
    try {
      if (name == "--device") options.device = value;
      else if (name == "--epochs") options.epochs = std::stoi(value);
      else if (name == "--batch-size") options.batch_size = std::stoi(value);
      else if (name == "--lr") options.lr = std::stod(value);
      else if (name == "--seed") options.seed = std::stoi(value);
      else throw UsageError("unknown option " + name + " (" + kUsage + ")");
    } catch (const std::logic_error&) {  // std::stoi and std::stod: not a number
      throw UsageError(name + " expects a number, not '" + value + "'");
    }
  }
  if (options.device != "auto" && options.device != "cpu" && options.device != "cuda")
    throw UsageError("--device must be auto, cpu or cuda, not '" + options.device + "'");
  if (options.epochs < 1 || options.batch_size < 1)
    throw UsageError("--epochs and --batch-size must be at least 1");
  return options;
}

// The scheduler's word that this job was given GPUs, as NAME=value, or "": lists of GPU
// indices ("0" is a GPU), then counts ("0" is none; the guide's .pbs scripts export JOB_GPUS).
// Inside a Slurm step (srun), SLURM_JOB_GPUS is the job's, copied into every step: not counted.
std::string gpus_given() {
  const bool in_step = std::getenv("SLURM_STEP_ID") != nullptr;
  for (const char* name :
       {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SGE_HGR_gpu", "PBS_NGPUS", "JOB_GPUS"}) {
    const char* value = std::getenv(name);
    const std::string text = value ? value : "";
    const bool count = std::string(name) == "PBS_NGPUS" || std::string(name) == "JOB_GPUS";
    const bool none = text.empty() || (count ? text == "0"
                                             : text == "(null)" || text == "-1" ||
                                                   text == "NoDevFiles");
    if (!none && !(in_step && std::string(name) == "SLURM_JOB_GPUS"))
      return std::string(name) + "=" + text;
  }
  return "";
}

// Whether this node has GPU device files (/dev/nvidia0, ... or AMD's /dev/kfd).
bool gpu_node() {
  std::error_code error;
  if (std::filesystem::exists("/dev/kfd", error)) return true;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 6 && name.starts_with("nvidia") &&
        std::isdigit(static_cast<unsigned char>(name[6])))
      return true;
  }
  return false;
}

// Whether this runs in an Apptainer/Singularity or Podman container.
bool in_container() {
  std::error_code error;
  for (const char* name : {"APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container"})
    if (const char* value = std::getenv(name); value && *value) return true;
  return std::filesystem::exists("/.singularity.d", error) ||
         std::filesystem::exists("/run/.containerenv", error);
}

std::string host_name() {
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 ? name : "unknown";
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

int train(const Options& options) {
  const bool cuda = torch::cuda::is_available();
  std::cout << "LibTorch " << TORCH_VERSION << " (C++ " << __cplusplus << ", compiler "
            << __VERSION__ << ")\n";
  std::cout << "CUDA available: "
            << (cuda ? "yes, " + std::to_string(torch::cuda::device_count()) + " GPU(s)" : "no")
            << "\n";
  if (options.device == "cuda" && !cuda)
    throw UsageError(
        "--device cuda but no GPU is visible: run on a GPU node (Slurm --gpus-per-node=1, PBS "
        "-l select=1:ngpus=1, Grid Engine -l gpu=1) or pass --device cpu");
  // A job given GPUs, on a GPU node or in a container, never trains on the CPU unnoticed.
  std::string given;
  if (options.device == "auto" && !cuda) {
    const bool devices = gpu_node();
    if (devices || in_container()) given = gpus_given();
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    const std::string bare = visible ? visible : "";
    if (devices && given.empty() && !bare.empty() && bare != "(null)" && bare != "-1" &&
        bare != "NoDevFiles")
      given = "CUDA_VISIBLE_DEVICES=" + bare;
    if (!given.empty())
      throw UsageError("this job was given GPUs (" + given + ") but LibTorch " + TORCH_VERSION +
                       " can use none: " +
                       (devices ? "run check_pytorch.py in the job to see why"
                                : "start the container with GPU support (apptainer --nv, "
                                  "podman --gpus all)") +
                       ", or pass --device cpu");
  }
  const bool use_cuda = options.device == "cuda" || (options.device == "auto" && cuda);
  const torch::Device device(use_cuda ? torch::kCUDA : torch::kCPU);
  if (use_cuda)  // one line per GPU that ran: make site-check counts them
    std::cout << "GPU in use: cuda:0 on " << host_name() << "\n";

  // Generated data: 1024 samples of 16 features, on the device.
  torch::manual_seed(options.seed);
  const int64_t samples = 1024;
  const auto x = torch::randn({samples, 16});
  const auto y = x.matmul(torch::randn({16, 1})) + 0.1 * torch::randn({samples, 1});
  const auto inputs = x.to(device), targets = y.to(device);

  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 1));
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(options.lr).momentum(0.9));
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  std::cout << "Training on " << device << ": " << samples << " samples, " << parameters
            << " parameters, torch::get_num_threads() = " << torch::get_num_threads() << "\n";

  for (int epoch = 1; epoch <= options.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    const auto order = torch::randperm(samples, torch::TensorOptions(torch::kLong).device(device));
    auto total = torch::zeros({}, device);  // summed on the device: no sync per batch
    for (int64_t first = 0; first < samples; first += options.batch_size) {
      const auto batch = order.slice(0, first, first + options.batch_size);
      const auto loss = torch::mse_loss(model->forward(inputs.index_select(0, batch)),
                                        targets.index_select(0, batch));
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      total += loss.detach() * batch.size(0);
    }
    const double loss = total.item<double>() / samples;  // waits for the GPU
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << loss
              << ", " << std::setprecision(0) << samples / seconds.count() << " samples/s\n"
              << std::defaultfloat;
  }
  return 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  // No exception leaves main: an uncaught one would end the program with "terminate called
  // after throwing an instance of 'c10::Error'" and a long backtrace.
  try {
    return train(parse_args(argc, argv));
  } catch (const UsageError& error) {
    std::cerr << "example: error: " << error.what() << "\n";
    return 2;
  } catch (const c10::Error& error) {  // raised by LibTorch: shapes, devices, options...
    std::cerr << "example: error: " << first_line(error.what_without_backtrace()) << "\n";
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "example: error: " << first_line(error.what()) << "\n";
    return 1;
  }
}
