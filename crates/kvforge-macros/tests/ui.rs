//! Compile-time behaviour of the macros, checked with trybuild: `pass/` must compile and run,
//! `fail/` must fail with the messages in the `.stderr` files next to them
//! (regenerate with `TRYBUILD=overwrite cargo test -p kvforge-macros`, then read them).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/pass/*.rs");
    t.compile_fail("tests/fail/*.rs");
}
