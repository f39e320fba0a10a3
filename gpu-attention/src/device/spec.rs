//! [`AttentionDevice`]: where an attention node computes (`--device`, `[attention] device`).

use std::fmt;

use candle_core::Device;

/// Where an attention node computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum AttentionDevice {
    /// The host's CPUs through afd's own kernels (the fast CPU path).
    #[default]
    Cpu,
    /// The device path (what `cuda` runs) on candle's CPU device: the same code as on a GPU,
    /// with the custom ops' CPU implementations. Slower than `cpu`; it checks the CUDA build's
    /// path on a machine without a GPU.
    CandleCpu,
    /// NVIDIA GPU `N` through candle's CUDA backend (needs a build with `--features cuda`).
    Cuda(usize),
}

/// Why a device cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Not one of the accepted spellings.
    #[error("unknown device `{0}`: expected cpu, cuda, cuda:N (N the GPU's index) or candle-cpu")]
    Unknown(String),
    /// A CUDA device in a build without the `cuda` feature.
    #[error(
        "--device {0} needs a build with CUDA: rebuild with `cargo build --release --features cuda` \
         (nvcc on the PATH), or use --device cpu"
    )]
    NotBuilt(AttentionDevice),
    /// The driver or the GPU refused.
    #[error(
        "cannot open {device}: {message} (is the NVIDIA driver loaded and does nvidia-smi list GPU {index}?)"
    )]
    Open {
        /// The device asked for.
        device: AttentionDevice,
        /// Its index.
        index: usize,
        /// What candle/CUDA said.
        message: String,
    },
}

impl AttentionDevice {
    /// Whether this is the fast host path (no candle device path).
    pub fn is_host(self) -> bool {
        self == AttentionDevice::Cpu
    }

    /// Whether this is an NVIDIA GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, AttentionDevice::Cuda(_))
    }

    /// The candle device of the device path (`None` for the host path). A CUDA device gets a
    /// stream of its own, so that every thread that steps the node queues on the same stream.
    pub fn open(self) -> Result<Option<Device>, DeviceError> {
        match self {
            AttentionDevice::Cpu => Ok(None),
            AttentionDevice::CandleCpu => Ok(Some(Device::Cpu)),
            AttentionDevice::Cuda(index) => {
                if !cfg!(feature = "cuda") {
                    return Err(DeviceError::NotBuilt(self));
                }
                Device::new_cuda_with_stream(index)
                    .map(Some)
                    .map_err(|e| DeviceError::Open {
                        device: self,
                        index,
                        message: e.to_string(),
                    })
            }
        }
    }
}

impl fmt::Display for AttentionDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionDevice::Cpu => f.write_str("cpu"),
            AttentionDevice::CandleCpu => f.write_str("candle-cpu"),
            AttentionDevice::Cuda(0) => f.write_str("cuda"),
            AttentionDevice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for AttentionDevice {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(AttentionDevice::Cpu),
            "candle-cpu" => Ok(AttentionDevice::CandleCpu),
            "cuda" => Ok(AttentionDevice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(AttentionDevice::Cuda)
                .ok_or_else(|| DeviceError::Unknown(other.to_string())),
        }
    }
}

impl serde::Serialize for AttentionDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for AttentionDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip() {
        for (text, device) in [
            ("cpu", AttentionDevice::Cpu),
            ("candle-cpu", AttentionDevice::CandleCpu),
            ("cuda", AttentionDevice::Cuda(0)),
            ("cuda:3", AttentionDevice::Cuda(3)),
        ] {
            assert_eq!(text.parse::<AttentionDevice>().unwrap(), device);
            assert_eq!(device.to_string(), text);
        }
        assert_eq!(
            "cuda:0".parse::<AttentionDevice>().unwrap(),
            AttentionDevice::Cuda(0)
        );
        for bad in ["gpu", "cuda:", "cuda:x", "h100", "CPU"] {
            let err = bad.parse::<AttentionDevice>().unwrap_err().to_string();
            assert!(err.contains("cuda:N"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_host_path_opens_no_device_and_candle_cpu_opens_the_cpu() {
        assert!(AttentionDevice::Cpu.open().unwrap().is_none());
        assert!(matches!(
            AttentionDevice::CandleCpu.open().unwrap(),
            Some(Device::Cpu)
        ));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build_it() {
        let err = AttentionDevice::Cuda(1).open().unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}
