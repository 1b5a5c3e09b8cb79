//! The per-tier side tables: the arrays a tier's codecs need on the device beside its pages
//! (spherical codebooks and radius scales, mixed-key channel orders), as each codec declares
//! them (`kvforge_spec::Codec::side_tables`: name, element type, elements per kv head, and
//! whether the spec fills it, the caller must set it, or null is the codec's default). The
//! kernels find table `slot` of tier `t` at `DecodeParams::side[t][slot]` /
//! `TranscodeParams::side[t][slot]`, `[num_kv_heads][len]` elements.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use kvforge_spec::codecs::side_slots;
use kvforge_spec::{SideElem, SideInit, SideTable, Spec, TierId};

use crate::error::{drv, Result, RtError};

/// One table's device buffer.
pub(crate) enum SideBuf {
    F32(CudaSlice<f32>),
    U16(CudaSlice<u16>),
}

struct Slot {
    decl: SideTable,
    buf: Option<SideBuf>,
    /// The buffer still holds what the spec filled in (`SideInit::Spec`), not a caller's table.
    from_spec: bool,
}

/// Every tier's side tables, in the slots its codecs declare.
pub struct SideTables {
    tiers: Vec<Vec<Slot>>,
    kv_heads: usize,
}

impl SideTables {
    /// Declares every tier's tables at head dim `d` and uploads those the spec fills (one copy
    /// per kv head); the others stay unset.
    pub(crate) fn new(spec: &Spec, d: usize, kv_heads: usize, stream: &Arc<CudaStream>) -> Result<SideTables> {
        let mut tiers = Vec::with_capacity(spec.tiers.len());
        for t in &spec.tiers {
            let mut slots = Vec::new();
            for decl in side_slots(&*t.key.codec(), &*t.value.codec(), d) {
                let from_spec = matches!(decl.init, SideInit::Spec(_));
                let buf = match &decl.init {
                    SideInit::Spec(data) => {
                        let all = data.repeat(kv_heads);
                        Some(SideBuf::F32(stream.clone_htod(&all).map_err(drv(format!("{} upload", decl.name)))?))
                    }
                    SideInit::Required | SideInit::Optional => None,
                };
                slots.push(Slot { decl, buf, from_spec });
            }
            tiers.push(slots);
        }
        Ok(SideTables { tiers, kv_heads })
    }

    fn slot(&self, tier: TierId, name: &str) -> Option<&Slot> {
        self.tiers.get(tier as usize)?.iter().find(|s| s.decl.name == name)
    }

    /// Whether `tier`'s codecs declare a table `name`.
    pub(crate) fn declares(&self, tier: TierId, name: &str) -> bool {
        self.slot(tier, name).is_some()
    }

    /// Whether `tier`'s table `name` is declared and set.
    pub(crate) fn is_set(&self, tier: TierId, name: &str) -> bool {
        self.slot(tier, name).is_some_and(|s| s.buf.is_some())
    }

    /// Whether `tier`'s table `name` still holds the spec's contents (never set by a caller).
    pub(crate) fn is_from_spec(&self, tier: TierId, name: &str) -> bool {
        self.slot(tier, name).is_some_and(|s| s.from_spec)
    }

    /// The first table of `tier` that must be set before its pages are coded or read and is
    /// not.
    pub(crate) fn missing(&self, tier: TierId) -> Option<&'static str> {
        self.tiers.get(tier as usize)?.iter().find(|s| s.decl.init == SideInit::Required && s.buf.is_none()).map(|s| s.decl.name)
    }

    /// Elements of table `name` per kv head, if `tier` declares it.
    pub(crate) fn len_per_head(&self, tier: TierId, name: &str) -> Option<usize> {
        self.slot(tier, name).map(|s| s.decl.len)
    }

    fn checked(&self, tier: TierId, name: &str, elem: SideElem, found: usize) -> Result<()> {
        let Some(s) = self.slot(tier, name) else {
            return Err(RtError::BadTier(tier, format!("its codecs have no `{name}` side table")));
        };
        let want = self.kv_heads * s.decl.len;
        if s.decl.elem != elem || found != want {
            return Err(RtError::BadInput(format!("{name}: need {} kv heads × {} = {want} {:?} values, got {found}", self.kv_heads, s.decl.len, s.decl.elem)));
        }
        Ok(())
    }

    fn put(&mut self, tier: TierId, name: &str, buf: SideBuf) {
        let s = self.tiers[tier as usize].iter_mut().find(|s| s.decl.name == name).expect("checked");
        s.buf = Some(buf);
        s.from_spec = false;
    }

    /// Sets f32 table `name` of `tier`: `[num_kv_heads][len]` values.
    pub(crate) fn set_f32(&mut self, stream: &Arc<CudaStream>, tier: TierId, name: &str, data: &[f32]) -> Result<()> {
        self.checked(tier, name, SideElem::F32, data.len())?;
        let buf = stream.clone_htod(data).map_err(drv(format!("{name} upload")))?;
        self.put(tier, name, SideBuf::F32(buf));
        Ok(())
    }

    /// Sets u16 table `name` of `tier`: `[num_kv_heads][len]` values.
    pub(crate) fn set_u16(&mut self, stream: &Arc<CudaStream>, tier: TierId, name: &str, data: &[u16]) -> Result<()> {
        self.checked(tier, name, SideElem::U16, data.len())?;
        let buf = stream.clone_htod(data).map_err(drv(format!("{name} upload")))?;
        self.put(tier, name, SideBuf::U16(buf));
        Ok(())
    }

    /// f32 table `name` of `tier`, once set.
    pub(crate) fn get_f32(&self, stream: &Arc<CudaStream>, tier: TierId, name: &str) -> Result<Option<Vec<f32>>> {
        match self.slot(tier, name).and_then(|s| s.buf.as_ref()) {
            Some(SideBuf::F32(b)) => Ok(Some(stream.clone_dtoh(b).map_err(drv(format!("{name} download")))?)),
            _ => Ok(None),
        }
    }

    /// u16 table `name` of `tier`, once set.
    pub(crate) fn get_u16(&self, stream: &Arc<CudaStream>, tier: TierId, name: &str) -> Result<Option<Vec<u16>>> {
        match self.slot(tier, name).and_then(|s| s.buf.as_ref()) {
            Some(SideBuf::U16(b)) => Ok(Some(stream.clone_dtoh(b).map_err(drv(format!("{name} download")))?)),
            _ => Ok(None),
        }
    }

    /// Device pointers `[tier][slot]` for the params' `side` field (null where unset).
    pub(crate) fn pointers(&self, stream: &Arc<CudaStream>) -> [[u64; 2]; 16] {
        let mut out = [[0u64; 2]; 16];
        for (t, slots) in self.tiers.iter().enumerate() {
            for (i, s) in slots.iter().enumerate() {
                out[t][i] = match &s.buf {
                    Some(SideBuf::F32(b)) => b.device_ptr(stream).0,
                    Some(SideBuf::U16(b)) => b.device_ptr(stream).0,
                    None => 0,
                };
            }
        }
        out
    }
}
