//! Kernel parameter structs, rendered by kvforge-gen from the same field list as the C++
//! structs the kernels take.

include!(concat!(env!("OUT_DIR"), "/params.rs"));

// SAFETY: #[repr(C)] plain-old-data mirrors of the C++ parameter structs.
unsafe impl cudarc::driver::DeviceRepr for DecodeParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for TranscodeParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for CombineParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MassWindowParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for CertSelectParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for CertBoundParams {}
