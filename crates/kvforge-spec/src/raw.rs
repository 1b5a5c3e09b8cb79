//! The TOML shape of a spec, exactly as written. Fields that are cross-checked keep their
//! spans so errors can point at them. Only `validate` turns this into a [`crate::Spec`].

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawSpec {
    pub spec: RawMeta,
    pub geometry: RawGeometry,
    #[serde(default)]
    pub page: RawPage,
    #[serde(rename = "tier")]
    pub tiers: Spanned<Vec<RawTier>>,
    #[serde(default)]
    pub kernels: RawKernels,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawMeta {
    pub name: Spanned<String>,
    #[serde(default)]
    pub description: String,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawGeometry {
    pub head_dims: Spanned<Vec<Spanned<i64>>>,
    pub gqa: Spanned<Vec<Spanned<i64>>>,
    #[serde(default = "fp16")]
    pub dtype: Spanned<String>,
}

fn fp16() -> Spanned<String> {
    Spanned::new(0..0, "fp16".to_string())
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawPage {
    pub tokens: Option<Spanned<i64>>,
    pub alignment: Option<Spanned<i64>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawTier {
    pub name: Spanned<String>,
    pub key: Spanned<RawScheme>,
    pub value: Spanned<RawScheme>,
}

/// One scheme table. Fields are a union over all schemes; `validate` rejects the ones a
/// scheme does not take, naming the valid ones.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawScheme {
    pub scheme: Spanned<String>,
    pub bits: Option<Spanned<i64>>,
    pub block: Option<Spanned<i64>>,
    pub group: Option<Spanned<i64>>,
    pub scale_dtype: Option<Spanned<String>>,
    pub granularity: Option<Spanned<String>>,
    pub angle_bits: Option<Spanned<i64>>,
    pub radius_bits: Option<Spanned<i64>>,
    pub codebook: Option<Spanned<String>>,
    /// Mixed keys: share of head_dim per bit width, e.g. `{ 8 = 0.25, 4 = 0.5 }`.
    pub channels: Option<Spanned<std::collections::BTreeMap<String, Spanned<f64>>>>,
    /// Rotated tiers: the seed of the Hadamard rotation's signs.
    pub seed: Option<Spanned<i64>>,
}

impl RawScheme {
    /// The fields given besides `scheme`, with their spans: what a codec's `only` checks
    /// against the fields it takes. A scheme with a new field adds it above and here.
    pub fn present(&self) -> Vec<(&'static str, std::ops::Range<usize>)> {
        let fields: [(&str, Option<std::ops::Range<usize>>); 10] = [
            ("bits", self.bits.as_ref().map(|x| x.span())),
            ("block", self.block.as_ref().map(|x| x.span())),
            ("group", self.group.as_ref().map(|x| x.span())),
            ("scale_dtype", self.scale_dtype.as_ref().map(|x| x.span())),
            ("granularity", self.granularity.as_ref().map(|x| x.span())),
            ("angle_bits", self.angle_bits.as_ref().map(|x| x.span())),
            ("radius_bits", self.radius_bits.as_ref().map(|x| x.span())),
            ("codebook", self.codebook.as_ref().map(|x| x.span())),
            ("channels", self.channels.as_ref().map(|x| x.span())),
            ("seed", self.seed.as_ref().map(|x| x.span())),
        ];
        fields.into_iter().filter_map(|(n, s)| s.map(|s| (n, s))).collect()
    }
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawKernels {
    pub combinations: Option<Spanned<Vec<Spanned<Vec<Spanned<String>>>>>>,
    pub split_k: Option<bool>,
    pub warps: Option<Spanned<i64>>,
    pub tensor_core_values: Option<bool>,
    pub certified: Option<Spanned<bool>>,
    pub ctas_per_sm: Option<Spanned<i64>>,
    pub stage_kib: Option<Spanned<i64>>,
    pub dense: Option<Spanned<RawShape>>,
}

/// `kernels.dense`: the launch shape of decode variants whose tiers are all dense.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawShape {
    pub warps: Option<Spanned<i64>>,
    pub ctas_per_sm: Option<Spanned<i64>>,
}
